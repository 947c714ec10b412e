"""DeepSpeed's config utilities (``deepspeed.runtime.config_utils``), served by ``ds_config.config_utils``: the
same objects, so a model subclassing ``DeepSpeedConfigModel`` from either path is the same class."""

from ds_config.config_utils import (
    DeepSpeedConfigModel,
    DeepSpeedConfigObject,
    ScientificNotationEncoder,
    dict_raise_error_on_duplicate_keys,
    get_config_default,
    get_dict_param,
    get_list_param,
    get_scalar_param,
    pp_int,
)

__all__ = [
    "DeepSpeedConfigModel",
    "DeepSpeedConfigObject",
    "ScientificNotationEncoder",
    "dict_raise_error_on_duplicate_keys",
    "get_config_default",
    "get_dict_param",
    "get_list_param",
    "get_scalar_param",
    "pp_int",
]

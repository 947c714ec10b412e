"""``deepspeed.runtime.zero``: ZeRO's names as DeepSpeed's package exports them (``zero.Init``,
``GatheredParameters``, ``unwrap_model_for_generation``, ...). The submodules DeepSpeed has here (``config``,
``stage3``, ``partition_parameters``, ...) are rows of ``deepspeed._compat_paths`` served by ds-zero/ds-config;
``linear``, ``leaf_module_config`` and ``generation`` are modules of this package."""

from deepspeed.compat import submodule_getattr
from deepspeed.runtime.zero.generation import unwrap_model_for_generation
from ds_zero.partition_parameters import ZeroParamType
from ds_zero.zero3 import (
    GatheredParameters,
    Init,
    MiCS_Init,
    TiledLinear,
    TiledLinearReturnBias,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "MiCS_Init", "TiledLinear", "TiledLinearReturnBias", "ZeroParamStatus",
           "ZeroParamType", "register_external_parameter", "unregister_external_parameter",
           "unwrap_model_for_generation"]

__getattr__ = submodule_getattr(__name__)  # deepspeed.runtime.zero.stage3 & co. as attributes, as in DeepSpeed

"""``deepspeed.runtime.zero.partition_parameters``: DeepSpeed's module path for ``zero.Init`` and friends."""

from ds_zero.zero3._param import ZeroParamStatus
from ds_zero.zero3.init import (
    GatheredParameters,
    Init,
    _orig_torch_arange,
    register_external_parameter,
    unregister_external_parameter,
    zero_wrapper_for_fp_tensor_constructor,
)
from ds_zero.zero3.leaf import z3_leaf_module, z3_leaf_parameter

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "_orig_torch_arange",
    "register_external_parameter",
    "unregister_external_parameter",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

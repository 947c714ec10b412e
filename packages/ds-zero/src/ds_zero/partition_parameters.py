"""``deepspeed.runtime.zero.partition_parameters``: DeepSpeed's module path for ``zero.Init`` and friends."""

from ds_zero.zero3._param import ZeroParamStatus
from ds_zero.zero3.init import GatheredParameters, Init, register_external_parameter, unregister_external_parameter
from ds_zero.zero3.leaf import z3_leaf_module, z3_leaf_parameter

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

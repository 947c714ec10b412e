"""``deepspeed.utils``: the ``DeepSpeed`` logger and small helpers, and ZeRO's debug/modification APIs.

Submodules: ``logging`` (logger, ``log_dist``), ``comms_logging`` (the ``comms_logger`` records),
``zero_to_fp32`` (ds-zero's checkpoint converter), ``groups`` (the data/model/tensor/sequence process-group
accessors, read from the registered mpu). The ``safe_*`` functions come from ``ds_zero.debug`` and the ZeRO-3
leaf-module functions (``set_z3_leaf_modules``, ...) from ``ds_zero.zero3.leaf``, and are imported on first use,
so ``import deepspeed`` stays free of torch.
"""

from typing import Any

from deepspeed.compat import submodule_getattr
from deepspeed.utils.logging import get_log_level_from_string, log_dist, logger, set_log_level_from_string

_ZERO_DEBUG = (
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_full_grad",
    "safe_update_full_grad_vectorized",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
)

_Z3_LEAF = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
            "z3_leaf_parameter", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix")

__all__ = ["OnDevice", "RepeatingLoader", "get_log_level_from_string", "instrument_w_nvtx", "log_dist", "logger",
           "set_log_level_from_string", *_ZERO_DEBUG, *_Z3_LEAF]


def __getattr__(name: str) -> Any:
    if name == "RepeatingLoader":  # DeepSpeed exports it here too (pipeline scripts import it from utils)
        from deepspeed.runtime.dataloader import RepeatingLoader

        return RepeatingLoader
    if name == "OnDevice":
        from deepspeed.utils.init_on_device import OnDevice

        return OnDevice
    if name == "instrument_w_nvtx":
        from deepspeed.utils.nvtx import instrument_w_nvtx

        return instrument_w_nvtx
    if name in _ZERO_DEBUG or name in _Z3_LEAF:
        import ds_zero.debug
        import ds_zero.zero3.leaf

        value = getattr(ds_zero.debug if name in _ZERO_DEBUG else ds_zero.zero3.leaf, name)
        globals()[name] = value
        return value
    return _submodule(name)


_submodule = submodule_getattr(__name__)

"""``deepspeed.runtime.zero.partition_parameters``: DeepSpeed's module path for ``zero.Init`` and friends."""

from collections.abc import Iterable
from enum import Enum
from typing import Any

from ds_zero.zero3.init import (
    GatheredParameters,
    Init,
    _contradicting_single_rank_pg_error,
    _orig_torch_arange,
    _orig_torch_empty,
    _orig_torch_eye,
    _orig_torch_full,
    _orig_torch_ones,
    _orig_torch_randn,
    _orig_torch_tensor,
    _orig_torch_zeros,
    register_external_parameter,
    unregister_external_parameter,
    zero_wrapper_for_fp_tensor_constructor,
)
from ds_zero.zero3.leaf import z3_leaf_module, z3_leaf_parameter
from ds_zero.zero3.param import ZeroParamStatus
from ds_zero.zeropp.param_quantizer import CUDAQuantizer

partitioned_param_data_shape = [0]
"""The shape of a partitioned parameter's ``.data`` while it is not gathered (an empty placeholder)."""


class ZeroParamType(Enum):
    """DeepSpeed's parameter kinds: a plain parameter, a ZeRO-3 partitioned one, one held remotely (NVMe)."""

    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


def get_allgather_dtype(param: Any, param_ds_tensor: Any) -> Any:
    """The dtype ``param``'s partitions travel in when gathered: its torch_autocast communication dtype when it has
    one, else its partition's own dtype."""
    from ds_zero._reduce import AUTOCAST_COMM_DTYPE_ATTR

    return getattr(param, AUTOCAST_COMM_DTYPE_ATTR, param_ds_tensor.dtype)


class MultipleAllGatherHandles:
    """Several in-flight all-gathers (one per process group of a fetch) waited as one handle."""

    def __init__(self, handles: Iterable[Any]) -> None:
        self.handles = list(handles)

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)

__all__ = [
    "CUDAQuantizer",
    "GatheredParameters",
    "MultipleAllGatherHandles",
    "get_allgather_dtype",
    "ZeroParamType",
    "partitioned_param_data_shape",
    "Init",
    "ZeroParamStatus",
    "_contradicting_single_rank_pg_error",
    "_orig_torch_arange",
    "_orig_torch_empty",
    "_orig_torch_eye",
    "_orig_torch_full",
    "_orig_torch_ones",
    "_orig_torch_randn",
    "_orig_torch_tensor",
    "_orig_torch_zeros",
    "register_external_parameter",
    "unregister_external_parameter",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

"""The flops profiler, standalone: parameters, MACs, FLOPs and latency of any ``torch.nn.Module``, per
module and in total, forward and (optionally) backward. Depends on torch only."""

from ds_profiler import profiler
from ds_profiler.__about__ import __version__
from ds_profiler.profiler import (
    FlopsProfiler,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "__version__",
    "profiler",
    "FlopsProfiler",
    "get_model_profile",
    "number_to_string",
    "macs_to_string",
    "flops_to_string",
    "bytes_to_string",
    "params_to_string",
    "duration_to_string",
]

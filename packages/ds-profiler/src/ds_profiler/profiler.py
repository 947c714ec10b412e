"""The documented module ``deepspeed.profiling.flops_profiler.profiler``: the profiler class, the one-call
model profile and the number-formatting helpers."""

from ds_profiler._format import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from ds_profiler._model_profile import get_model_profile
from ds_profiler._profiler import FlopsProfiler

__all__ = [
    "FlopsProfiler",
    "get_model_profile",
    "number_to_string",
    "macs_to_string",
    "flops_to_string",
    "bytes_to_string",
    "params_to_string",
    "duration_to_string",
]

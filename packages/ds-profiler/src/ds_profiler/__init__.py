"""The flops profiler, standalone: count parameters, MACs, FLOPs and latency of any torch."""

from ds_profiler.__about__ import __version__

__all__ = ["__version__"]

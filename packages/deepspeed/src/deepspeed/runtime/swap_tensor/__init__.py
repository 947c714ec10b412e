"""``deepspeed.runtime.swap_tensor``: ZeRO-Infinity's NVMe swapping (ds-zero's ``ds_zero.swap``) under DeepSpeed's
package path, with DeepSpeed's size floor for swapping."""

from ds_zero.swap import OptimizerSwapper, ParamSwapper, is_swapped

MIN_AIO_BYTES = 1024 ** 2
"""Tensors smaller than this (bytes) are not worth an asynchronous NVMe transfer."""
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES

__all__ = ["MIN_AIO_BYTES", "MIN_SWAPPABLE_BYTES", "OptimizerSwapper", "ParamSwapper", "is_swapped"]

"""Native operators: SIMD, multi-threaded CPU Adam/Adagrad/Lion written in C++ and compiled with ninja (just-in-time or at install), fused GPU optimizers built on torch's multi-tensor kernels, and asynchronous file/NVMe I/O over libaio through cffi."""

from ds_ops.__about__ import __version__

__all__ = ["__version__"]

"""Native operators for DeepSpeed.

SIMD, multi-threaded CPU Adam/Adagrad/Lion written in C++ and compiled with ninja (just-in-time or at
install), fused GPU optimizers built on torch's multi-tensor kernels, and asynchronous file/NVMe I/O
over libaio through cffi.
"""

from ds_ops.__about__ import __version__
from ds_ops.adagrad import DeepSpeedCPUAdagrad
from ds_ops.adam import DeepSpeedCPUAdam, FusedAdam
from ds_ops.aio import AioError, AsyncIOHandle
from ds_ops.lamb import FusedLamb
from ds_ops.lion import DeepSpeedCPULion, FusedLion
from ds_ops.op_builder import OpBuildError

__all__ = [
    "AioError",
    "AsyncIOHandle",
    "DeepSpeedCPUAdagrad",
    "DeepSpeedCPUAdam",
    "DeepSpeedCPULion",
    "FusedAdam",
    "FusedLamb",
    "FusedLion",
    "OpBuildError",
    "__version__",
]

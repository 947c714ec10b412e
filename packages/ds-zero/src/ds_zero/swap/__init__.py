"""ZeRO-Infinity: swapping ZeRO-3 state to NVMe through ``ds_ops.aio``.

- :class:`OptimizerSwapper` (``offload_optimizer.device: nvme``): fp32 masters and optimizer states of each
  sub-group in per-rank swap files, streamed through the step;
- :class:`ParamSwapper` (``offload_param.device: nvme``): the 16-bit parameter partitions, read ahead of their
  all-gather and dropped after it;
- :class:`BufferPool`: the bounded set of page-aligned (optionally locked) CPU buffers both swap through, and
  the ownership rule of each buffer (who may read or reuse it after which wait), enforced
  (:class:`BufferInFlightError`).

``DS_SWAP_IO_JITTER_MS`` (tests only, ``ds_zero.swap._jitter``) delays every swap transfer at random.
"""

from ds_zero.swap.buffer_pool import BufferInFlightError, BufferPool
from ds_zero.swap.optimizer_swapper import OptimizerSwapper, OptimizerSwapSettings
from ds_zero.swap.param_swapper import ParamSwapper, ParamSwapSettings, is_swapped

__all__ = ["BufferInFlightError", "BufferPool", "OptimizerSwapSettings", "OptimizerSwapper", "ParamSwapSettings",
           "ParamSwapper", "is_swapped"]

"""Communication-compressed optimizers: 1-bit Adam (``adam.OnebitAdam``), 0/1 Adam (``zoadam.ZeroOneAdam``),
1-bit LAMB (``lamb.OnebitLamb``).

They average gradients themselves (full precision for ``freeze_step`` warm-up steps, then 1-bit compressed
momentum with error feedback, ``deepspeed.runtime.comm.compressed``), so the engine does not all-reduce
gradients for them (DeepSpeed's ``enable_backward_allreduce=False``; see ``_engine``). ZeRO stage 0 only.
"""

from deepspeed.runtime.fp16.onebit.adam import OnebitAdam
from deepspeed.runtime.fp16.onebit.lamb import OnebitLamb
from deepspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"]

"""Communication-compressed optimizers: 1-bit Adam (``adam.OnebitAdam``).

They average gradients themselves (full precision for ``freeze_step`` warm-up steps, then 1-bit compressed
momentum with error feedback, ``deepspeed.runtime.comm.compressed``), so the engine does not all-reduce
gradients for them (DeepSpeed's ``enable_backward_allreduce=False``; see ``_engine``). ZeRO stage 0 only.
"""

from deepspeed.runtime.fp16.onebit.adam import OnebitAdam

__all__ = ["OnebitAdam"]

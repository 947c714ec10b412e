"""DeepSpeed-Ulysses sequence parallelism: ``deepspeed.sequence.layer.DistributedAttention``.

Each rank of a sequence-parallel group holds a slice of the sequence; an all-to-all trades it for a slice of
the attention heads over the full sequence, any local attention runs, and a second all-to-all trades back.
"""

from deepspeed.sequence.layer import DistributedAttention

__all__ = ["DistributedAttention"]

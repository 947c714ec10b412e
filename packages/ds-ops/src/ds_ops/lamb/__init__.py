"""LAMB optimizer (``deepspeed.ops.lamb``)."""

from ds_ops.lamb.fused_lamb import FusedLamb

__all__ = ["FusedLamb"]

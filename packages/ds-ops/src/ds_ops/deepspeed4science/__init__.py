"""DeepSpeed4Science ops (``deepspeed.ops.deepspeed4science``): the Evoformer attention of AlphaFold-style models."""

from ds_ops.deepspeed4science.evoformer_attn import DS4Sci_EvoformerAttention, EvoformerFusedAttention

__all__ = ["DS4Sci_EvoformerAttention", "EvoformerFusedAttention"]

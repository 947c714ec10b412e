"""Sub-configs of ``DeepSpeedInferenceConfig``: dtype, tensor parallel, MoE, quantization, checkpoint."""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import Field

from ds_config._typed_section import Bool, PosInt, SectionModel


class DtypeEnum(str, Enum):
    """Inference data types, by short name; ``torch_name`` is the ``torch`` attribute (no torch import here)."""

    fp16 = "fp16"
    fp32 = "fp32"
    bf16 = "bf16"
    int8 = "int8"

    def __eq__(self, other: object) -> bool:
        # DeepSpeed scripts compare ``config.dtype == torch.half``: a torch.dtype equals its member
        if type(other).__module__ == "torch" and type(other).__name__ == "dtype":
            return str(other) == f"torch.{self.torch_name}"
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = str.__hash__

    @property
    def torch_name(self) -> str:
        """Name of the matching ``torch.dtype`` attribute (``getattr(torch, d.torch_name)``)."""
        return _TORCH_NAMES[self]

    @classmethod
    def parse(cls, value: Any) -> DtypeEnum:
        """Accept an enum member, a torch.dtype, or a name such as 'fp16', 'float16', 'half', 'torch.bfloat16'."""
        if isinstance(value, cls):
            return value
        if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
            value = str(value)  # torch.float16 -> "torch.float16", without importing torch
        if isinstance(value, str):
            key = value.strip().lower().removeprefix("torch.")
            if key in _SPELLINGS:
                return _SPELLINGS[key]
        accepted = ", ".join(sorted(_SPELLINGS))
        raise ValueError(f"unsupported dtype; accepted: {accepted} (or the matching torch.dtype)")


_TORCH_NAMES = {DtypeEnum.fp16: "float16", DtypeEnum.fp32: "float32", DtypeEnum.bf16: "bfloat16",
                DtypeEnum.int8: "int8"}
_SPELLINGS = {
    "fp16": DtypeEnum.fp16, "float16": DtypeEnum.fp16, "half": DtypeEnum.fp16,
    "fp32": DtypeEnum.fp32, "float32": DtypeEnum.fp32, "float": DtypeEnum.fp32,
    "bf16": DtypeEnum.bf16, "bfloat16": DtypeEnum.bf16, "bfloat": DtypeEnum.bf16,
    "int8": DtypeEnum.int8,
}


class MoETypeEnum(str, Enum):
    """Kinds of MoE layer."""

    residual = "residual"
    standard = "standard"


class DeepSpeedTPConfig(SectionModel):
    """Configure tensor parallelism settings."""

    enabled: Bool = True
    """Turn tensor parallelism on/off."""

    tp_size: PosInt = 1
    """Number of devices to split the model across using tensor parallelism."""

    tp_grain_size: PosInt = 64
    """MLP/lm_head split granularity (elements); kernels favour powers of two."""

    mpu: Any = None
    """Model parallelism unit implementing ``get_{model,data}_parallel_{rank,group,world_size}()``."""

    tp_group: Any = None
    """Process group for tensor parallelism."""


class DeepSpeedMoEConfig(SectionModel):
    """Sets parameters for MoE."""

    enabled: Bool = True

    ep_size: PosInt = 1
    """Expert-parallel size: GPUs the experts are partitioned across."""

    moe_experts: list[PosInt] = Field(default_factory=lambda: [1], alias="num_experts")
    """The global number of experts used in an MoE layer (one entry per MoE layer kind)."""

    type: MoETypeEnum = MoETypeEnum.standard
    """'standard' or 'residual' MoE layer."""

    ep_mp_group: Any = None
    """Expert/model-parallel process group."""

    ep_group: Any = Field(None, alias="expert_group")
    """Expert-parallel process group."""


class _QuantBase(SectionModel):
    enabled: Bool = True
    num_bits: PosInt = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: PosInt = 1


class ActivationQuantConfig(_QuantBase):
    """Activation quantization (bits, symmetric/asymmetric, groups)."""


class WeightQuantConfig(_QuantBase):
    """Weight quantization; the two dicts tune quantize-at-load and quantize-after-init."""

    quantized_initialization: dict[str, Any] = Field(default_factory=dict)
    post_init_quant: dict[str, Any] = Field(default_factory=dict)


class QKVQuantConfig(SectionModel):
    """Quantization of the fused QKV projection."""

    enabled: Bool = True


class QuantizationConfig(SectionModel):
    """MoQ quantization of an inference model (only used with the int8 dtype)."""

    enabled: Bool = True
    activation: ActivationQuantConfig = Field(default_factory=ActivationQuantConfig)
    weight: WeightQuantConfig = Field(default_factory=WeightQuantConfig)
    qkv: QKVQuantConfig = Field(default_factory=QKVQuantConfig)


class InferenceCheckpointConfig(SectionModel):
    """Where an inference checkpoint is read from and a re-sharded one written to."""

    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None

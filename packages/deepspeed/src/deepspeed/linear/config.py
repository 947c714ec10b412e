"""``deepspeed.linear`` configuration: ``LoRAConfig`` (low-rank adapters over a frozen, optionally sharded base
weight) and ``QuantizationConfig`` (FP8 storage of frozen weights). Plain dataclasses, as in DeepSpeed, checked on
construction."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LLAMA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """LoRA settings of ``LoRAOptimizedLinear``.

    lora_r: adapter rank (default 64). lora_alpha: scaling numerator; the adapter output is multiplied by
    ``lora_alpha / lora_r`` (default 16). base_weight_sharding: ranks the frozen base weight is split over (1:
    not split; otherwise the world size). offload / offload_ratio: accepted for DeepSpeed configs; this version
    keeps base weights where the model puts them (docs/deviations.md). delay_lora_init: create the adapters
    later with ``init_lora`` (``deepspeed.linear.Init`` sets it). target_mods: module-name fragments whose
    checkpoint weights load into LoRA layers; others turn back into a plain linear (default: Llama's projections).
    """

    lora_r: int = 64
    lora_alpha: float = 16.0
    base_weight_sharding: int = 1
    offload: bool = False
    offload_ratio: float = 0.0
    delay_lora_init: bool = False
    target_mods: list[str] = field(default_factory=lambda: list(LLAMA_TARGET_MODULES))

    def __post_init__(self) -> None:
        if not isinstance(self.lora_r, int) or self.lora_r < 1:
            raise ValueError(f"LoRAConfig.lora_r={self.lora_r!r}: the adapter rank must be an int >= 1")
        if not isinstance(self.base_weight_sharding, int) or self.base_weight_sharding < 1:
            raise ValueError(f"LoRAConfig.base_weight_sharding={self.base_weight_sharding!r}: must be an int >= 1 "
                             "(1 = not sharded, else the data-parallel world size)")
        if not 0.0 <= float(self.offload_ratio) <= 1.0:
            raise ValueError(f"LoRAConfig.offload_ratio={self.offload_ratio!r}: must be within [0, 1]")


# (q_bits, mantissa_bits) -> the torch FP8 format storing it
FP8_FORMATS = {(8, 3): torch.float8_e4m3fn, (8, 2): torch.float8_e5m2}


@dataclass
class QuantizationConfig:
    """Quantized storage of frozen linear weights: ``q_bits`` bits with ``mantissa_bits`` of mantissa, one scale per
    ``group_size`` consecutive values, codes stored as ``q_dtype`` (default uint8). This version supports the FP8
    formats (q_bits=8 with mantissa_bits 3: e4m3, or 2: e5m2); DeepSpeed's CUDA kernel also has FP6/FP12."""

    q_bits: int = 8
    mantissa_bits: int = 3
    group_size: int = 512
    q_dtype: torch.dtype = torch.uint8

    def __post_init__(self) -> None:
        if (self.q_bits, self.mantissa_bits) not in FP8_FORMATS:
            raise ValueError(f"QuantizationConfig(q_bits={self.q_bits!r}, mantissa_bits={self.mantissa_bits!r}) is "
                             f"not supported; accepted (q_bits, mantissa_bits): {sorted(FP8_FORMATS)}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"QuantizationConfig.group_size={self.group_size!r}: must be an int >= 1")
        if self.q_dtype != torch.uint8:
            raise ValueError(f"QuantizationConfig.q_dtype={self.q_dtype!r}: codes are stored as torch.uint8")

    @property
    def fp8_dtype(self) -> torch.dtype:
        return FP8_FORMATS[(self.q_bits, self.mantissa_bits)]

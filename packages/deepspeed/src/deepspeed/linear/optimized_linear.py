"""``OptimizedLinear``: a drop-in for ``nn.Linear`` that becomes a LoRA layer over a frozen base weight, the base
weight optionally split across ranks (``LoRAConfig.base_weight_sharding``) and/or stored in FP8
(``QuantizationConfig``).

Sharding: rank ``r`` of ``S`` holds elements ``[r * n / S, (r + 1) * n / S)`` of the row-major ``[out, in]`` base
weight flattened (``n = out * in``); forward all-gathers it (no gradient: the base is frozen), so each rank keeps
1/S of the base weight between forwards. The base weight carries ``ds_optim_param = True``, DeepSpeed's mark for
"unique per rank: do not broadcast at engine start". Only the adapters train.
"""

from __future__ import annotations

import math
from dataclasses import is_dataclass

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.linear.config import LoRAConfig, QuantizationConfig
from deepspeed.linear.quantization import QuantizedLinear, QuantizedParameter


class OptimizedLinear(nn.Module):
    """``OptimizedLinear(input_dim, output_dim, bias=False, lora_config=None, quantization_config=None, device=None,
    dtype=torch.bfloat16, linear_cls=nn.Linear)`` builds: a ``linear_cls`` when both configs are None, a
    :class:`LoRAOptimizedLinear` with a LoRA config, else a :class:`QuantizedLinear`."""

    def __new__(cls, input_dim: int, output_dim: int, bias: bool = False, lora_config: LoRAConfig | None = None,
                quantization_config: QuantizationConfig | None = None, device=None, dtype=torch.bfloat16,
                linear_cls=nn.Linear):
        if quantization_config is not None and not is_dataclass(quantization_config):
            raise ValueError(f"quantization_config: expected a QuantizationConfig, got {type(quantization_config)}")
        if lora_config is not None and not is_dataclass(lora_config):
            raise ValueError(f"lora_config: expected a LoRAConfig, got {type(lora_config)}")
        if lora_config is not None:
            return LoRAOptimizedLinear(input_dim, output_dim, bias=bias, lora_config=lora_config,
                                       quantization_config=quantization_config, device=device, dtype=dtype,
                                       linear_cls=linear_cls)
        if quantization_config is not None:
            return QuantizedLinear(input_dim, output_dim, bias=bias, quantization_config=quantization_config,
                                   dtype=dtype)
        return linear_cls(input_dim, output_dim, bias=bias, dtype=dtype, device=device)


def _xavier_uniform_(flat: torch.Tensor, fan_in: int, fan_out: int) -> None:
    """Xavier-uniform values for (a shard of) an ``[fan_out, fan_in]`` weight held flat."""
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        flat.uniform_(-bound, bound)


class LoRAOptimizedLinear(nn.Module):
    """``y = x W^T + (lora_alpha / lora_r) * B(A(x))`` with ``W`` frozen (sharded and/or FP8) and ``A``
    (``lora_weight_1``, kaiming-uniform) and ``B`` (``lora_weight_2``, zeros) trainable ``linear_cls`` layers."""

    def __init__(self, input_dim: int, output_dim: int, bias: bool = False, lora_config: LoRAConfig | None = None,
                 quantization_config: QuantizationConfig | None = None, device=None, dtype=torch.bfloat16,
                 linear_cls=nn.Linear):
        super().__init__()
        if lora_config is None:
            raise ValueError("LoRAOptimizedLinear needs a lora_config (a deepspeed.linear.LoRAConfig)")
        if bias:
            raise ValueError("LoRAOptimizedLinear(bias=True) is not supported: the frozen base has no bias")
        if quantization_config is not None and dtype != torch.bfloat16:
            raise ValueError(f"LoRAOptimizedLinear: quantization needs dtype=torch.bfloat16, got {dtype}")
        self.input_dim, self.output_dim, self.bias, self.dtype = input_dim, output_dim, bias, dtype
        self.lora_config, self.quantization_config, self.linear_cls = lora_config, quantization_config, linear_cls
        self.device = get_accelerator().current_device_name() if device is None else device
        self.zero_shards = lora_config.base_weight_sharding
        numel = input_dim * output_dim
        if self.zero_shards > 1:
            world = dist.get_world_size() if dist.is_initialized() else 1
            if self.zero_shards != world:
                raise ValueError(f"LoRAConfig.base_weight_sharding={self.zero_shards} must equal the world size "
                                 f"({world}; torch.distributed initialised: {dist.is_initialized()})")
            if numel % self.zero_shards:
                raise ValueError(f"a {output_dim}x{input_dim} base weight cannot be split into "
                                 f"base_weight_sharding={self.zero_shards} equal shards")
            base = torch.empty(numel // self.zero_shards, dtype=dtype)
        else:
            base = torch.empty((output_dim, input_dim), dtype=dtype)
        self.sharded_weight_size = base.numel()
        _xavier_uniform_(base, input_dim, output_dim)
        self.weight = self._frozen(base)
        self.disabled = False
        self._initialized = False
        if not lora_config.delay_lora_init:
            self.init_lora()

    def _frozen(self, tensor: torch.Tensor) -> nn.Parameter:
        if self.quantization_config is not None:
            return QuantizedParameter(tensor, quantization_config=self.quantization_config)
        return nn.Parameter(tensor, requires_grad=False)

    def disable(self) -> None:
        """Turn into a plain frozen ``[out, in]`` linear (a checkpointed module outside ``target_mods``)."""
        self.disabled = True
        for name in ("lora_weight_1", "lora_weight_2"):
            self._modules.pop(name, None)
        self.weight = nn.Parameter(torch.empty((self.output_dim, self.input_dim), dtype=self.dtype),
                                   requires_grad=False)

    def init_lora(self) -> None:
        """Create the adapters (A kaiming-uniform, B zeros, so the layer starts equal to its base) and freeze W."""
        if self.disabled:
            return
        if self.quantization_config is not None and not isinstance(self.weight, QuantizedParameter):
            self.weight = self._frozen(self.weight.data)  # a loader replaced the quantized parameter
        self.weight.requires_grad = False
        self.weight.ds_optim_param = True
        self.lora_scaling_factor = self.lora_config.lora_alpha / self.lora_config.lora_r
        rank = self.lora_config.lora_r
        self.lora_weight_1 = self.linear_cls(self.input_dim, rank, bias=False, device=self.device, dtype=self.dtype)
        self.lora_weight_2 = self.linear_cls(rank, self.output_dim, bias=False, device=self.device, dtype=self.dtype)
        nn.init.kaiming_uniform_(self.lora_weight_1.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_weight_2.weight)
        self.lora_weight_1.weight.requires_grad = True
        self.lora_weight_2.weight.requires_grad = True
        self._initialized = True

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if not any(target in prefix for target in self.lora_config.target_mods):
            self.disable()
        elif self.zero_shards > 1 and f"{prefix}weight" in state_dict:
            full = state_dict[f"{prefix}weight"]
            if full.numel() == self.input_dim * self.output_dim:  # a full checkpoint weight: keep this rank's part
                start = dist.get_rank() * self.sharded_weight_size
                state_dict[f"{prefix}weight"] = full.flatten().narrow(0, start, self.sharded_weight_size)
        return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                             unexpected_keys, error_msgs)

    def _local_weight(self) -> torch.Tensor:
        weight = self.weight
        return weight.dequantized() if isinstance(weight, QuantizedParameter) else weight

    def full_weight(self) -> torch.Tensor:
        """The whole ``[out, in]`` base weight (all-gathered from the shards when sharded)."""
        local = self._local_weight()
        if self.zero_shards == 1:
            return local
        full = torch.empty(self.output_dim * self.input_dim, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(full, local.detach().contiguous())
        return full.view(self.output_dim, self.input_dim)

    def forward(self, input_tensor: torch.Tensor) -> torch.Tensor:
        if self.disabled:
            return F.linear(input_tensor, self.weight)
        if not self._initialized:
            raise RuntimeError("LoRAOptimizedLinear: the adapters were never created; call "
                               "deepspeed.linear.init_lora(model) (or the layer's init_lora()) before forward")
        with torch.no_grad():
            base = self.full_weight()
        base_out = F.linear(input_tensor, base)
        return base_out + self.lora_scaling_factor * self.lora_weight_2(self.lora_weight_1(input_tensor))

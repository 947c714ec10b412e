"""``deepspeed.runtime.weight_quantizer``: DeepSpeed's symmetric int8 weight quantization of Megatron-style
transformer weights (MoQ inference checkpoints), with its scale layout.

A tensor is cut into ``groups`` equal runs of its flattened values; each run gets the scale
``2**bits / (2 * max|x| + 1e-5)`` and its values become ``round(x * scale)`` clamped to the signed ``bits`` range,
stored as int8. What a layer keeps is the reciprocal of each scale (the factor that dequantizes), per weight:
attention QKV, attention output (dense), MLP h->4h and MLP 4h->h. ``merge_scales`` stacks them per layer in that
order, each row zero-padded to the widest, as DeepSpeed's inference kernels read them. MLP weights get twice the
groups with ``mlp_extra_grouping`` (they are four times wider).
"""

from __future__ import annotations

from typing import Any

import torch

_KINDS = ("qkv", "dense", "mlp_h4h", "mlp_4hh")


def _kind(key: str) -> str:
    if "mlp.dense_4h_to_h.weight" in key:
        return "mlp_4hh"
    if "mlp.dense_h_to_4h.weight" in key:
        return "mlp_h4h"
    if "attention.query_key_value.weight" in key:
        return "qkv"
    return "dense"


class WeightQuantization:
    """Quantizes weights group-wise and collects their dequantization scales per kind of weight (DeepSpeed's
    class: ``mp_size`` is the tensor-parallel size the weights are cut for)."""

    def __init__(self, mlp_extra_grouping: bool = True, mp_size: int = 1) -> None:
        self.mlp_extra_grouping = mlp_extra_grouping
        self.mp_size = mp_size
        self._scales: dict[str, list[torch.Tensor]] = {kind: [] for kind in _KINDS}

    # DeepSpeed's attribute names for the collected scales
    dense_scales = property(lambda self: self._scales["dense"])
    qkv_scales = property(lambda self: self._scales["qkv"])
    mlp4hh_scales = property(lambda self: self._scales["mlp_4hh"])
    mlph4h_scales = property(lambda self: self._scales["mlp_h4h"])

    def quantize_data(self, data: torch.Tensor, quantize_bits: int, groups: int,
                      key: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int8 values of data's shape, (runs, 1) quantization scales)``: runs of ``numel // groups`` values
        (one more, shorter run when ``groups`` does not divide the values, as in DeepSpeed)."""
        if not isinstance(groups, int) or not 0 < groups <= data.numel():
            raise ValueError(f"quantize_data: groups={groups!r} is invalid for {key or 'a tensor'} of "
                             f"{data.numel()} values; accepted: 1 to {data.numel()}")
        if not 2 <= quantize_bits <= 8:
            raise ValueError(f"quantize_data: quantize_bits={quantize_bits} is invalid; accepted: 2 to 8 "
                             "(int8 storage)")
        runs = torch.split(data.detach().float().reshape(-1), data.numel() // groups)
        low, high = -(1 << (quantize_bits - 1)), (1 << (quantize_bits - 1)) - 1
        scales = [float(1 << quantize_bits) / (2 * run.abs().max() + 1e-5) for run in runs]
        values = torch.cat([(run * scale).round().clamp(low, high) for run, scale in zip(runs, scales, strict=True)])
        return values.to(torch.int8).reshape(data.shape), torch.stack(scales).view(-1, 1)

    def is_mlp(self, data: torch.Tensor, merge_count: int = 1) -> bool:
        rows, cols = data.shape[0], data.shape[1]
        return self.mp_size * rows * merge_count / cols == 4 or self.mp_size * cols * merge_count / rows == 4

    def is_qkv(self, data: torch.Tensor) -> bool:
        rows, cols = data.shape[0], data.shape[1]
        return self.mp_size * rows / cols == 3 or self.mp_size * cols / rows == 3

    def Quantize(self, value_list: list[torch.Tensor], quantize_bits: int, groups: int, key: str,  # noqa: N802
                 merge_dim: int = 0) -> list[torch.Tensor]:
        """Quantize the tensor-parallel pieces of one weight in place of ``value_list``; record the weight's
        dequantization scales (one row, the pieces' scales joined along ``merge_dim``)."""
        if self.mlp_extra_grouping and self.is_mlp(value_list[0], merge_count=len(value_list)):
            groups *= 2
        scales = []
        for i, data in enumerate(value_list):
            value_list[i], scale = self.quantize_data(data, quantize_bits, groups, key)
            scales.append(scale)
        self._scales[_kind(key)].append((1 / torch.cat(scales, dim=merge_dim)).view(1, -1))
        return value_list

    @staticmethod
    def merge_layer_scales(layer_scales: list[torch.Tensor]) -> torch.Tensor:
        """One layer's scale rows, zero-padded to the widest: ``(1, len(layer_scales), width)``."""
        width = max(s.shape[-1] for s in layer_scales)
        padded = [torch.nn.functional.pad(s, (0, width - s.shape[-1])) for s in layer_scales]
        return torch.cat(padded).unsqueeze(0)

    def _layers(self) -> list[tuple[torch.Tensor, ...]]:
        counts = {kind: len(rows) for kind, rows in self._scales.items()}
        if len(set(counts.values())) != 1:
            raise ValueError(f"merge_scales: every layer needs its four quantized weights; collected {counts}")
        return list(zip(*(self._scales[kind] for kind in _KINDS), strict=True))

    def merge_scales(self) -> torch.Tensor:
        """``(layers, 4, width)``: per layer the QKV, dense, h->4h and 4h->h scale rows."""
        return torch.cat([self.merge_layer_scales(list(layer)) for layer in self._layers()])

    def merge_scales_split(self, split_count: int) -> list[list[torch.Tensor]]:
        """The scales cut for ``split_count`` tensor-parallel ranks: per rank, per layer, a ``(1, 4, width)``
        block; the QKV and dense rows are zero-padded to twice their width, as DeepSpeed lays them out."""
        out: list[list[torch.Tensor]] = [[] for _ in range(split_count)]
        for qkv, dense, h4h, hh4 in self._layers():
            pieces = [torch.split(s, s.numel() // split_count, dim=-1) for s in (qkv, dense, h4h, hh4)]
            for rank in range(split_count):
                q, d, a, b = (p[rank] for p in pieces)
                out[rank].append(torch.cat([torch.cat((q, torch.zeros_like(q)), dim=1),
                                            torch.cat((d, torch.zeros_like(d)), dim=1), a, b]).unsqueeze(0))
        return out

    def sd_quantize_megatron(self, sd: dict[str, Any], quantize_bits: int,
                             groups: int) -> tuple[dict[str, Any], torch.Tensor]:
        """Quantize a Megatron module state dict's four transformer weights per layer, in place; ``(sd, scales)``."""
        for key in list(sd.keys()):
            if any(part in key for part in ("attention.dense.weight", "mlp.dense_4h_to_h.weight",
                                            "mlp.dense_h_to_4h.weight", "attention.query_key_value.weight")):
                sd[key] = self.Quantize([sd[key]], quantize_bits, groups, key=key)[0]
        return sd, self.merge_scales()

    def model_quantize(self, model: torch.nn.Module, quantize_policy: dict[type, Any] | None, quantize_bits: int,
                       groups: int) -> tuple[torch.nn.Module, torch.Tensor]:
        """Quantize, in place, the four transformer weights of every layer ``quantize_policy`` names (layer class
        -> DeepSpeed injection-policy class, whose ``attention()`` and ``mlp()`` return the weights)."""
        if not quantize_policy:
            raise ValueError("model_quantize: quantize_policy is required (layer class -> policy class with "
                             "attention() and mlp()); DeepSpeed's built-in kernel-injection policies are not built "
                             "in this version")
        layers = []
        for module in model.modules():
            policy_cls = quantize_policy.get(type(module))
            if policy_cls is None:
                continue
            policy = policy_cls(module)
            _, qkvw, _, dense_w, _, _ = policy.attention()
            _, h4h_w, _, hh4_w, _ = policy.mlp()
            rows = []
            for weight in (qkvw, dense_w, h4h_w, hh4_w):
                extra = 2 if self.mlp_extra_grouping and self.is_mlp(weight) else 1
                values, scale = self.quantize_data(weight, quantize_bits, groups * extra)
                with torch.no_grad():
                    weight.copy_(values)
                rows.append((1 / scale).view(1, -1))
            layers.append(self.merge_layer_scales(rows))
        if not layers:
            raise ValueError("model_quantize: no module of the model has a class named in quantize_policy "
                             f"({sorted(c.__name__ for c in quantize_policy)})")
        return model, torch.cat(layers)

"""Repacking a Hugging Face experts module into this rank's grouped expert weights (DeepSpeed's ``ep_repack``).

Sources: fused 3-D tensors (``gate_up_proj`` ``[E, 2*ffn, hidden]`` + ``down_proj`` ``[E, hidden, ffn]``, or the
transposed ``[E, hidden, 2*ffn]`` + ``[E, ffn, hidden]``, or separate gate / up / down 3-D tensors), or an
``nn.ModuleList`` of per-expert MLPs. Result, for experts ``[ep_rank * L, (ep_rank + 1) * L)``:
``w1`` (gate) ``[L, ffn, hidden]``, ``w2`` (down) ``[L, hidden, ffn]``, ``w3`` (up) ``[L, ffn, hidden]``: copies,
bit-identical to the source values. Source parameters partitioned by ZeRO-3 are gathered while they are read
(``GatheredParameters``, all ranks of their group together).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ds_moe.fused_expert_layout import classify_fused_gate_up_layout

__all__ = ["GatheredParameters", "repack_expert_requires_grad_flags", "repack_expert_weights"]


def is_zero_param(param: Any) -> bool:
    """A ZeRO-3 partitioned parameter (it carries ZeRO's ``ds_id``)."""
    return param is not None and hasattr(param, "ds_id")


class GatheredParameters:
    """Gather ZeRO-3 partitioned parameters for the block, release on exit (read only: ``modifier_rank`` must be
    None). Uses the parameters' own ``all_gather`` / ``partition`` (ZeRO-3's per-parameter API), so MoE needs no
    import of the ZeRO package."""

    def __init__(self, params: Iterable[Any], modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        if modifier_rank is not None:
            raise ValueError(f"AutoEP only reads gathered source parameters; modifier_rank={modifier_rank!r} "
                             "(expected None)")
        self.params = [p for p in params if is_zero_param(p)] if enabled else []
        self.gathered: list[Any] = []

    def __enter__(self) -> None:
        if not self.params:
            return
        self.gathered = [p for p in self.params if getattr(p.ds_status, "name", "") == "NOT_AVAILABLE"]
        self.params[0].all_gather(param_list=self.params)

    def __exit__(self, *exc: Any) -> None:
        idle = [p for p in self.gathered if not getattr(p, "ds_active_sub_modules", None)]
        if idle:
            idle[0].partition(param_list=idle)


@contextmanager
def gather_source_zero_params(params: Iterable[Any]) -> Iterator[None]:
    """Full values of the ZeRO-3 partitioned ``params`` inside the block (None entries are skipped)."""
    zero_params = [p for p in params if is_zero_param(p)]
    if not zero_params:
        yield
        return
    with GatheredParameters(zero_params, modifier_rank=None, enabled=True):  # the module global: patchable
        yield


def _local_range(spec: Any, ep_rank: int, ep_size: int) -> tuple[int, int]:
    if spec.num_experts % ep_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"AutoEP repack of '{spec.moe_module_name}': ep_rank={ep_rank}, ep_size={ep_size} do not "
                         f"split num_experts={spec.num_experts} (ep_size must divide it, 0 <= ep_rank < ep_size)")
    local = spec.num_experts // ep_size
    return ep_rank * local, (ep_rank + 1) * local


def repack_expert_weights(experts_source: nn.Module, spec: Any, ep_rank: int,
                          ep_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(w1, w2, w3)`` of this rank's experts, copied from ``experts_source`` as ``spec`` (a ``MoELayerSpec``)
    describes it."""
    start, end = _local_range(spec, ep_rank, ep_size)
    if spec.expert_storage == "fused_3d":
        return _repack_fused(experts_source, spec, start, end)
    if spec.expert_storage == "module_list":
        return _repack_module_list(experts_source, spec, start, end)
    raise ValueError(f"MoELayerSpec.expert_storage={spec.expert_storage!r}; expected 'fused_3d' or 'module_list'")


def _repack_fused(experts: nn.Module, spec: Any, start: int, end: int) -> tuple[Tensor, Tensor, Tensor]:
    w1_full, w2_full = getattr(experts, spec.expert_w1_name), getattr(experts, spec.expert_w2_name)
    w3_full = getattr(experts, spec.expert_w3_name) if spec.expert_w3_name is not None else None
    with gather_source_zero_params([w1_full, w2_full, w3_full]):
        w1 = w1_full.data[start:end].clone()
        w2 = w2_full.data[start:end].clone()
        if w3_full is not None:
            return w1.contiguous(), w2.contiguous(), w3_full.data[start:end].clone().contiguous()
    layout = classify_fused_gate_up_layout(tuple(w1.shape), tuple(w2.shape))
    if layout is None:
        raise ValueError(f"AutoEP cannot repack '{spec.moe_module_name}': fused expert weights "
                         f"{spec.expert_w1_name}={tuple(w1.shape)} and {spec.expert_w2_name}={tuple(w2.shape)} are "
                         "neither [E, 2*ffn, hidden] + [E, hidden, ffn] nor [E, hidden, 2*ffn] + [E, ffn, hidden]")
    ffn = layout.ffn_hidden_size
    if layout.needs_transpose:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    return w1[:, :ffn].contiguous(), w2.contiguous(), w1[:, ffn:].contiguous()


def _expert_weight(expert: nn.Module, name: str) -> Tensor:
    """An expert MLP's weight ``name``: a parameter, or the ``weight`` of a child module (``nn.Linear``)."""
    found = getattr(expert, name, None)
    if isinstance(found, torch.Tensor):
        return found
    if found is not None and isinstance(getattr(found, "weight", None), torch.Tensor):
        return found.weight
    raise ValueError(f"AutoEP: expert module {type(expert).__name__} has no weight '{name}'; its parameters: "
                     f"{[n for n, _ in expert.named_parameters()]}")


def _expert_list(experts: nn.Module) -> nn.ModuleList:
    if not isinstance(experts, nn.ModuleList):
        raise ValueError(f"expert_storage='module_list' needs an nn.ModuleList of experts, got "
                         f"{type(experts).__name__}")
    return experts


def _repack_module_list(experts: nn.Module, spec: Any, start: int, end: int) -> tuple[Tensor, Tensor, Tensor]:
    names = [spec.expert_w1_name, spec.expert_w2_name] + ([spec.expert_w3_name] if spec.expert_w3_name else [])
    picked: list[list[Tensor]] = [[] for _ in names]
    # every rank gathers every expert, in expert order: ZeRO-3 gathers are collective over the whole group
    for index, expert in enumerate(_expert_list(experts)):
        weights = [_expert_weight(expert, name) for name in names]
        with gather_source_zero_params(weights):
            if start <= index < end:
                for bucket, weight in zip(picked, weights, strict=True):
                    bucket.append(weight.data.clone())
    for name, bucket in zip(names, picked, strict=True):
        _require_uniform(bucket, name, start, end)
    w1, w2 = torch.stack(picked[0]), torch.stack(picked[1])
    if spec.expert_w3_name:
        return w1, w2, torch.stack(picked[2])
    ffn = w1.shape[1] // 2  # per-expert fused [2*ffn, hidden]
    return w1[:, :ffn].contiguous(), w2, w1[:, ffn:].contiguous()


def _require_uniform(tensors: list[Tensor], name: str, start: int, end: int) -> None:
    dtype, device = tensors[0].dtype, tensors[0].device
    for index, tensor in enumerate(tensors, start=start):
        if (tensor.dtype, tensor.device) != (dtype, device):
            raise ValueError(f"AutoEP cannot keep mixed dtype/device across module_list experts {start}:{end} "
                             f"weight '{name}' (they become one grouped tensor): expert {start} is {dtype} on "
                             f"{device}, expert {index} is {tensor.dtype} on {tensor.device}")


def repack_expert_requires_grad_flags(experts_source: nn.Module, spec: Any, ep_rank: int,
                                      ep_size: int) -> tuple[bool, bool, bool]:
    """``requires_grad`` of the repacked ``(w1, w2, w3)``: the source's (w3 follows w1 when gate and up are
    fused). Per-expert sources must agree within this rank's experts."""
    start, end = _local_range(spec, ep_rank, ep_size)
    if spec.expert_storage == "fused_3d":
        w1 = bool(getattr(getattr(experts_source, spec.expert_w1_name), "requires_grad", False))
        w2 = bool(getattr(getattr(experts_source, spec.expert_w2_name), "requires_grad", False))
        w3 = w1 if spec.expert_w3_name is None else bool(
            getattr(getattr(experts_source, spec.expert_w3_name), "requires_grad", False))
        return w1, w2, w3
    local = list(_expert_list(experts_source))[start:end]

    def flag(name: str) -> bool:
        flags = {bool(_expert_weight(expert, name).requires_grad) for expert in local}
        if len(flags) != 1:
            raise ValueError(f"AutoEP cannot keep mixed requires_grad flags across module_list experts {start}:{end} "
                             f"weight '{name}' (they become one grouped tensor)")
        return flags.pop()

    w1 = flag(spec.expert_w1_name)
    return w1, flag(spec.expert_w2_name), flag(spec.expert_w3_name) if spec.expert_w3_name else w1

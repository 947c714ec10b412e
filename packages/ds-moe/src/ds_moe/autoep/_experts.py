"""This rank's share of a fused experts module, computing every routed token (dropless) across expert-parallel ranks.

:class:`AutoEPExperts` keeps the Hugging Face experts' call signature ``(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`` and parameter names (``gate_up_proj`` ``[L, 2 * ffn, H]``, ``down_proj``
``[L, H, ffn]``, ``L = num_experts / ep_size``), so it drops into the block where the full experts were.

Forward: sort the ``T * k`` token choices by expert; send each rank the rows for its experts (variable-split
all-to-all, skipped when ``ep_size == 1``); regroup the received rows by local expert; SwiGLU per expert as a
grouped matmul (``torch.nn.functional.grouped_mm`` where the kernel exists, else a plain loop over local
experts: the reference); send the rows back; weight each choice by its router weight and sum a token's choices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ds_moe.autoep._comm import all_to_all_v, exchange_counts, local_expert_order
from ds_moe.autoep._compat import _version_tuple

GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}


def _aligned(t: Tensor) -> bool:
    """The grouped-mm kernels need 16-byte aligned data and strides (other than the unit stride)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride() if s != 1)


def grouped_mm_available(x: Tensor, weight: Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` has a kernel for ``x @ weight[e].T`` (else the loop is used)."""
    if not hasattr(F, "grouped_mm") or weight.dtype not in GROUPED_MM_DTYPES.get(weight.device.type, ()):
        return False
    if weight.device.type == "cuda" and torch.cuda.get_device_capability(weight.device) < (8, 0):
        return False
    if weight.device.type == "cpu" and _version_tuple(torch.__version__)[:2] < (2, 9):
        return False  # no CPU kernel before torch 2.9
    out_row_bytes = weight.shape[1] * weight.element_size()  # the output's (and its gradient's) row stride
    return _aligned(x) and _aligned(weight) and out_row_bytes % 16 == 0


def loop_grouped_linear(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """Reference: rows ``x`` grouped by expert (``counts`` rows each) times ``weight[e].T``, one matmul per expert."""
    parts = [F.linear(rows, weight[e]) for e, rows in enumerate(torch.split(x, counts))]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def grouped_linear(x: Tensor, weight: Tensor, counts: Tensor, use_grouped_mm: bool = True) -> Tensor:
    """``x`` ``[N, in]`` rows grouped by expert, ``weight`` ``[L, out, in]``, ``counts`` ``[L]`` -> ``[N, out]``."""
    x = x.to(weight.dtype)
    if use_grouped_mm and grouped_mm_available(x, weight):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    return loop_grouped_linear(x, weight, counts.tolist())


def _inverse(perm: Tensor) -> Tensor:
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


class AutoEPExperts(nn.Module):
    """Experts ``[ep_rank * L, (ep_rank + 1) * L)`` of a layer with ``num_experts`` experts; parameters are marked
    for expert-data-parallel gradient reduction (``allreduce = False``, ``group_name = "ep_size_<ep_size>"``)."""

    def __init__(self, gate_up_proj: Tensor, down_proj: Tensor, act_fn: nn.Module, num_experts: int,
                 ep_size: int = 1, ep_rank: int = 0) -> None:
        super().__init__()
        if gate_up_proj.shape[0] * ep_size != num_experts:
            raise ValueError(f"{gate_up_proj.shape[0]} local experts x ep_size {ep_size} != {num_experts} experts")
        self.num_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        self.num_local_experts = gate_up_proj.shape[0]
        self.group_name = f"ep_size_{ep_size}"
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.act_fn = act_fn
        self.use_grouped_mm = True
        self.ep_group: dist.ProcessGroup | None = None  # bound by AutoEPMoELayer.set_deepspeed_parallelism
        for param in (self.gate_up_proj, self.down_proj):
            param.allreduce = False
            param.group_name = self.group_name

    @classmethod
    def from_fused(cls, experts: nn.Module, ep_size: int, ep_rank: int) -> AutoEPExperts:
        """This rank's slice (copied) of a Hugging Face fused experts module."""
        num_experts = experts.gate_up_proj.shape[0]
        local = num_experts // ep_size
        rows = slice(ep_rank * local, (ep_rank + 1) * local)
        with torch.no_grad():
            gate_up = experts.gate_up_proj.detach()[rows].clone()
            down = experts.down_proj.detach()[rows].clone()
        module = cls(gate_up, down, experts.act_fn, num_experts, ep_size, ep_rank)
        module.gate_up_proj.requires_grad_(experts.gate_up_proj.requires_grad)
        module.down_proj.requires_grad_(experts.down_proj.requires_grad)
        return module

    def extra_repr(self) -> str:
        first = self.ep_rank * self.num_local_experts
        return (f"experts {first}..{first + self.num_local_experts - 1} of {self.num_experts}, "
                f"ep_size={self.ep_size}, group_name={self.group_name!r}")

    def expert_ffn(self, x: Tensor, counts: Tensor) -> Tensor:
        """SwiGLU of rows grouped by local expert (``counts`` ``[L]``), HF's ``act(gate) * up`` then down."""
        gate, up = grouped_linear(x, self.gate_up_proj, counts, self.use_grouped_mm).chunk(2, dim=-1)
        return grouped_linear(self.act_fn(gate) * up, self.down_proj, counts, self.use_grouped_mm)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        num_tokens, k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        rows = hidden_states.index_select(0, order // k)
        if self.ep_size == 1:
            out = self.expert_ffn(rows, counts)
        else:
            out = self._across_ranks(rows, counts)
        weighted = out * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        combined = weighted.index_select(0, _inverse(order)).view(num_tokens, k, -1).sum(dim=1)
        return combined.to(hidden_states.dtype)

    def _across_ranks(self, rows: Tensor, counts: Tensor) -> Tensor:
        """Rows sorted by global expert -> the owners compute them -> the results, in the same order."""
        if self.ep_group is None:
            raise RuntimeError(f"AutoEP experts (ep_size={self.ep_size}) have no expert-parallel group: run "
                               "ds_moe.autoep.apply_autoep under torch.distributed, or set_deepspeed_parallelism()")
        received = exchange_counts(self.ep_group, counts)  # [ep, L]
        send = counts.view(self.ep_size, -1).sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()
        arrived = all_to_all_v(self.ep_group, rows, recv, send)
        regroup = local_expert_order(received)
        computed = self.expert_ffn(arrived.index_select(0, regroup), received.sum(dim=0))
        return all_to_all_v(self.ep_group, computed.index_select(0, _inverse(regroup)), send, recv)

"""AutoEP's experts: ``E`` SwiGLU MLPs held as three stacked weights, computed over rows grouped by expert
(DeepSpeed's ``ep_experts.GroupedExperts``).

``w1`` (gate) and ``w3`` (up) are ``[E, hidden_dim, dim]``, ``w2`` (down) ``[E, dim, hidden_dim]``; expert ``e``
computes ``(silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T`` for its rows. The grouped path runs each product as
one ``torch.nn.functional.grouped_mm`` (where this torch has a kernel for the dtype, device and alignment);
the loop path, one matmul per expert, is the reference and the fallback. Rows past ``sum(counts)`` (alignment
padding) come back as zeros.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}


def _torch_version() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def grouped_mm_supported() -> bool:
    """Whether this torch has ``torch.nn.functional.grouped_mm`` at all."""
    return hasattr(F, "grouped_mm")


def _aligned(t: Tensor) -> bool:
    """The grouped-mm kernels need 16-byte aligned data and strides (other than the unit stride)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride() if s != 1)


def grouped_mm_available(x: Tensor, weight: Tensor) -> bool:
    """Whether ``grouped_mm`` has a kernel for ``x @ weight[e].T`` here (else the loop runs)."""
    if not grouped_mm_supported() or weight.dtype not in GROUPED_MM_DTYPES.get(weight.device.type, ()):
        return False
    if weight.device.type == "cuda" and torch.cuda.get_device_capability(weight.device) < (8, 0):
        return False
    if weight.device.type == "cpu" and _torch_version() < (2, 9):
        return False  # no CPU kernel before torch 2.9
    out_row_bytes = weight.shape[1] * weight.element_size()  # the output's (and its gradient's) row stride
    return _aligned(x) and _aligned(weight) and out_row_bytes % 16 == 0


def loop_grouped_linear(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """Reference: rows ``x`` grouped by expert (``counts`` rows each) times ``weight[e].T``, one matmul each."""
    parts = [F.linear(rows, weight[e]) for e, rows in enumerate(torch.split(x, counts))]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def grouped_linear(x: Tensor, weight: Tensor, counts: Tensor, use_grouped_mm: bool = True) -> Tensor:
    """``x`` ``[N, in]`` rows grouped by expert, ``weight`` ``[E, out, in]``, ``counts`` ``[E]`` -> ``[N, out]``
    in ``x``'s dtype (the weight is cast, as DeepSpeed's experts compute in the activations' precision)."""
    weight = weight.to(x.dtype)
    if use_grouped_mm and grouped_mm_available(x, weight):
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=torch.cumsum(counts, 0, dtype=torch.int32))
    return loop_grouped_linear(x, weight, [int(c) for c in counts.tolist()])


class GroupedExperts(nn.Module):
    """``forward(x [N, dim] grouped by expert, num_tokens_per_expert [E]) -> [N, dim]``.

    ``use_grouped_mm=True`` asks for the grouped GEMM (``RuntimeError`` when this torch has none: pass False for
    the loop); it still falls back to the loop for inputs the kernel cannot take (dtype, alignment).
    ``disable_triton_grouped_mm`` is accepted for DeepSpeed's configs: no Triton kernel is used here."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True,
                 disable_triton_grouped_mm: bool = False) -> None:
        super().__init__()
        if use_grouped_mm and not grouped_mm_supported():
            raise RuntimeError("GroupedExperts(use_grouped_mm=True): this PyTorch has no torch.nn.functional."
                               f"grouped_mm (torch {torch.__version__}); upgrade PyTorch or set "
                               "expert_parallel.use_grouped_mm to false for the per-expert loop")
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        for weight in (self.w1, self.w2, self.w3):
            weight.is_expert_group = True
        self.use_grouped_mm = use_grouped_mm
        self.use_triton_grouped_mm = False
        self.disable_triton_grouped_mm = disable_triton_grouped_mm

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        counts = num_tokens_per_expert.to(torch.int64)
        used = int(counts.sum())
        rows = x[:used]
        hidden = F.silu(grouped_linear(rows, self.w1, counts, self.use_grouped_mm))
        hidden = hidden * grouped_linear(rows, self.w3, counts, self.use_grouped_mm)
        out = grouped_linear(hidden, self.w2, counts, self.use_grouped_mm)
        if used < x.shape[0]:
            out = torch.cat([out, out.new_zeros(x.shape[0] - used, out.shape[1])])
        return out

"""DeepSpeed's ``sharded_moe``: the top-k gate (``TopKGate``), the gating functions and ``MOELayer``.

``MOELayer`` implements GShard's algorithm 2: gate the ``S`` tokens, put them into per-expert buffers of
``capacity`` slots, all-to-all the buffers over the expert-parallel group so each rank holds its local
experts' slots from every rank, run the experts, all-to-all back and combine with the gate weights.
``MOELayer.dispatch_mode`` picks how tokens move in and out of the buffers: ``"indexed"`` (default, slot
indices, no ``[S, E, C]`` tensor) or ``"einsum"`` (DeepSpeed's dense one-hot einsums, the reference).
"""

from __future__ import annotations

import importlib.util
import logging
import time
import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_moe._alltoall import _AllToAll
from ds_moe._dispatch import (
    DISPATCH_MODES,
    check_dispatch_mode,
    combine,
    combine_einsum,
    dispatch,
    dispatch_einsum,
    route_slots,
    sparse_decode,
    sparse_encode,
    sparse_routes,
)
from ds_moe._gating import top1_routing, top2_routing, topk_routing
from ds_moe._noise import check_noisy_gate_policy, gumbel_rsample, multiplicative_jitter
from ds_moe._routing import Routing, capacity, dense_combine_weights

logger = logging.getLogger(__name__)

TUTEL_INSTALLED = importlib.util.find_spec("tutel") is not None
DEFAULT_DISPATCH_MODE = "indexed"
GateOutput = tuple[Tensor, Tensor, Tensor, Tensor]  # l_aux, combine_weights [S,E,C], dispatch_mask, exp_counts
# with sparse_routes=True: l_aux, capacity, num_experts, experts [k,S] (-1: dropped), locations [k,S], gates [k,S],
# exp_counts (DeepSpeed's sparse dispatch format)
SparseGateOutput = tuple[Tensor, Tensor, int, Tensor, Tensor, Tensor, Tensor]

__all__ = [
    "DEFAULT_DISPATCH_MODE", "DISPATCH_MODES", "MOELayer", "TUTEL_INSTALLED", "TopKGate", "_AllToAll",
    "gumbel_rsample", "multiplicative_jitter", "top1gating", "top2gating", "topkgating",
]
# DeepSpeed's names for the sparse dispatch helpers (its MOELayer and tests call them)
_route_slots, _sparse_encode, _sparse_decode = route_slots, sparse_encode, sparse_decode


def _dense(routing: Routing) -> GateOutput:
    combine_weights, dispatch_mask = dense_combine_weights(routing)
    return routing.l_aux, combine_weights, dispatch_mask, routing.exp_counts


def _sparse(routing: Routing) -> SparseGateOutput:
    experts, locations, gates = sparse_routes(routing)
    cap = torch.tensor(routing.capacity, dtype=torch.int64, device=experts.device)
    return routing.l_aux, cap, routing.num_experts, experts, locations, gates, routing.exp_counts


def _output(routing: Routing, sparse: bool) -> GateOutput | SparseGateOutput:
    return _sparse(routing) if sparse else _dense(routing)


def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    """DeepSpeed's helper: the capacity for ``gates`` ``[S, E]`` as an int64 tensor."""
    s, e = gates.shape
    return torch.tensor(capacity(s, e, float(capacity_factor), int(min_capacity)), dtype=torch.int64)


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: dist.ProcessGroup | None = None, sparse_routes: bool = False,
               use_tutel: bool = False) -> GateOutput | SparseGateOutput:
    """Top-1 gating on ``logits`` ``[S, E]`` -> ``(l_aux, combine_weights, dispatch_mask, exp_counts)``, or the
    sparse routes with ``sparse_routes=True`` (see ``SparseGateOutput``)."""
    return _output(top1_routing(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy,
                                drop_tokens, use_rts, ep_group), sparse_routes)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: dist.ProcessGroup | None = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> GateOutput | SparseGateOutput:
    """Top-2 gating on ``logits`` ``[S, E]`` -> ``(l_aux, combine_weights, dispatch_mask, exp_counts)``, or the
    sparse routes with ``sparse_routes=True``."""
    return _output(top2_routing(logits, capacity_factor, min_capacity, drop_tokens, ep_group,
                                top2_2nd_expert_sampling), sparse_routes)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: dist.ProcessGroup | None = None, drop_policy: str = "probs",
               sparse_routes: bool = False) -> GateOutput | SparseGateOutput:
    """Top-k gating on ``logits`` ``[S, E]`` -> ``(l_aux, combine_weights, dispatch_mask, exp_counts)``, or the
    sparse routes with ``sparse_routes=True``."""
    return _output(topk_routing(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy),
                   sparse_routes)


def _clock(reference: Tensor) -> float:
    """Seconds, after waiting for ``reference``'s device (so GPU work is counted)."""
    if reference.is_cuda:
        torch.cuda.synchronize(reference.device)
    return time.perf_counter()


class TopKGate(nn.Module):
    """The router: ``wg`` (``Linear(model_dim, num_experts, bias=False)``) then top-k gating in fp32 (top-1,
    top-2, or for ``k > 2`` :func:`topkgating` with its ``"probs"`` drop policy, as DeepSpeed's gate picks).

    Training uses ``capacity_factor`` and the noisy policy; eval uses ``eval_capacity_factor`` and no noise
    (``Jitter`` multiplies the input by U(0.99, 1.01); ``RSample`` adds Gumbel noise to top-1's logits).
    """

    wg: nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: dist.ProcessGroup | None = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(f"TopKGate: k must be an int from 1 to num_experts ({num_experts}), got k={k!r}")
        check_noisy_gate_policy(noisy_gate_policy)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0  # ms of the last forward, when wall_clock_breakdown

    def _set_ep_group(self, ep_group: dist.ProcessGroup | None) -> None:
        if self.ep_group is not None and ep_group is not self.ep_group:
            raise RuntimeError("Attempting to override an existing ep_group")
        self.ep_group = ep_group

    def route(self, input: Tensor, used_token: Tensor | None = None) -> Routing:  # noqa: A002
        """The sparse routing of ``input`` ``[S, model_dim]``."""
        start = _clock(input) if self.wall_clock_breakdown else 0.0
        input_fp32 = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            input_fp32 = multiplicative_jitter(input_fp32, device=input.device)
        logits = nn.functional.linear(input_fp32, weight=self.wg.weight.float(), bias=None)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            routing = top1_routing(logits, factor, self.min_capacity, used_token,
                                   self.noisy_gate_policy if self.training else None, self.drop_tokens,
                                   self.use_rts, self.ep_group)
        elif self.k == 2:
            routing = top2_routing(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                                   self.top2_2nd_expert_sampling)
        else:
            routing = topk_routing(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group)
        if self.wall_clock_breakdown:
            self.gate_time = (_clock(input) - start) * 1000.0
        return routing

    def forward(self, input: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False,  # noqa: A002
                use_tutel: bool = False) -> GateOutput | SparseGateOutput:
        """DeepSpeed's gate output: dense ``(l_aux, combine_weights, dispatch_mask, exp_counts)``, or with
        ``sparse_routes=True`` the routes (``SparseGateOutput``) its ``MOELayer`` dispatches from."""
        return _output(self.route(input, used_token), sparse_routes)


class MOELayer(nn.Module):
    """Gate, dispatch to the experts across the expert-parallel group, combine (GShard's algorithm 2).

    ``ep_group`` is set by :meth:`_set_ep_group` (``MoE.set_deepspeed_parallelism``); with ``ep_size == 1``
    none is needed. After a forward, ``l_aux`` and ``exp_counts`` hold the gate's loss and expert counts.
    """

    def __init__(self, gate: nn.Module, experts: nn.Module, ep_group_name: str | None, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.time_falltoall = 0.0  # ms, when wall_clock_breakdown
        self.time_salltoall = 0.0
        self.time_moe = 0.0
        self.wall_clock_breakdown = False
        self.use_tutel = False
        self.dispatch_mode = DEFAULT_DISPATCH_MODE
        if use_tutel:
            reason = "not installed" if not TUTEL_INSTALLED else "not supported by ds_moe"
            logger.warning("Tutel optimization requested but %s. Proceeding without Tutel.", reason)
            warnings.warn(f"use_tutel=True: Tutel is {reason}; proceeding without Tutel (built-in dispatch)",
                          RuntimeWarning, stacklevel=2)

    @property
    def dispatch_mode(self) -> str:
        """``"indexed"`` (slot indices, default) or ``"einsum"`` (DeepSpeed's dense one-hot reference)."""
        return self._dispatch_mode

    @dispatch_mode.setter
    def dispatch_mode(self, mode: str) -> None:
        self._dispatch_mode = check_dispatch_mode(mode)

    def _set_ep_group(self, ep_group: dist.ProcessGroup | None) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _exchange(self, buffers: Tensor) -> Tensor:
        if self.ep_size == 1:
            return buffers.contiguous()
        if self.ep_group is None:
            raise RuntimeError(f"MOELayer with ep_size={self.ep_size} has no expert-parallel group: call "
                               "MoE.set_deepspeed_parallelism() (deepspeed.initialize does) before forward")
        return _AllToAll.apply(self.ep_group, buffers)

    def _route(self, tokens: Tensor, used_token: Tensor | None) -> tuple[Tensor, Routing | None, Tensor | None]:
        """(expert buffers [E, C, M], routing or None, dense combine weights or None)."""
        if not hasattr(self.gate, "route"):  # a DeepSpeed-style gate returning dense weights only
            self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
            return dispatch_einsum(tokens, dispatch_mask), None, combine_weights
        routing = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        buffers, combine_weights = dispatch(tokens, routing, self.dispatch_mode)
        return buffers, routing, combine_weights

    def forward(self, input: Tensor, used_token: Tensor | None = None) -> Tensor:  # noqa: A002
        timed = self.wall_clock_breakdown
        start = _clock(input) if timed else 0.0
        d_model = input.shape[-1]
        tokens = input.reshape(-1, d_model)
        buffers, routing, combine_weights = self._route(tokens, used_token)
        t0 = _clock(buffers) if timed else 0.0
        buffers = self._exchange(buffers)
        if timed:
            self.time_falltoall = (_clock(buffers) - t0) * 1000.0
        expert_output = self.experts(buffers.reshape(self.ep_size, self.num_local_experts, -1, d_model))
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        t0 = _clock(expert_output) if timed else 0.0
        expert_output = self._exchange(expert_output)
        if timed:
            self.time_salltoall = (_clock(expert_output) - t0) * 1000.0
        if routing is None:
            combined = combine_einsum(expert_output, combine_weights)
        else:
            combined = combine(expert_output, routing, combine_weights)
        if timed:
            self.time_moe = (_clock(combined) - start) * 1000.0
        return combined.reshape(input.shape)

"""``AutoEPMoELayer``: a Hugging Face MoE block rebuilt with its experts sharded over the expert-parallel group
(DeepSpeed's ``deepspeed.module_inject.auto_ep_layer``).

The block's router becomes a :class:`~ds_moe.ep_router.TokenChoiceTopKRouter` (its weights copied; replicated,
data parallel), its experts this rank's :class:`~ds_moe.ep_experts.GroupedExperts` (``num_experts / ep_size`` of
them, ``w1`` / ``w2`` / ``w3``; gradients reduced over the expert-data-parallel group), shared experts are kept
as they are. Forward: route, sort the ``T * k`` choices by expert, send each rank the rows of its experts (one
all-to-all of the count matrix, then a variable-split all-to-all of rows; none when ``ep_size == 1``), compute,
send back, and combine each token's choices weighted by its scores (or with the scores applied to the inputs,
``score_apply='pre'``).
"""

from __future__ import annotations

import logging
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_moe import groups
from ds_moe.autoep._comm import _AllToAllV
from ds_moe.autoep.folded_forward import folded_expert_combine
from ds_moe.autoep.presets import resolve_autoep_config_defaults
from ds_moe.autoep.spec import AutoEPConfig, MoELayerSpec
from ds_moe.ep_count import count_tokens_per_expert
from ds_moe.ep_experts import GroupedExperts
from ds_moe.ep_kernels import permute_by_local_expert, unpermute_by_local_expert
from ds_moe.ep_repack import gather_source_zero_params, repack_expert_requires_grad_flags, repack_expert_weights
from ds_moe.ep_router import TokenChoiceTopKRouter

__all__ = ["AutoEPMoELayer", "RouterOutput", "SplitPlan", "_AllToAllV", "apply_scores_before_experts_if_enabled",
           "combine_from_routed", "compute_split_plan", "compute_split_plan_from_expert_indices", "dist",
           "resolve_combine_impl", "resolve_score_apply_mode"]

logger = logging.getLogger(__name__)


class RouterOutput(NamedTuple):
    top_scores: Tensor  # [T, K]
    selected_experts: Tensor  # [T, K]
    num_tokens_per_expert: Tensor  # [E] int32


class SplitPlan(NamedTuple):
    """One rank's share of a dispatch: rows sent to / received from each expert-parallel rank, and the received
    rows per local expert (in total and per source rank)."""

    input_splits: list[int]  # [ep_size]
    output_splits: list[int]  # [ep_size]
    local_counts: Tensor  # [E_local]
    local_counts_by_source: Tensor  # [ep_size, E_local]


def resolve_score_apply_mode(spec: MoELayerSpec, config_override: str) -> Literal["pre", "post"]:
    """The config's ``score_apply`` unless 'auto', else the preset's (recorded in the spec)."""
    return config_override if config_override != "auto" else spec.score_apply  # type: ignore[return-value]


def resolve_combine_impl(config_override: str) -> Literal["weighted_sum", "legacy_bmm"]:
    return config_override if config_override != "auto" else "weighted_sum"  # type: ignore[return-value]


def apply_scores_before_experts_if_enabled(routed_input: Tensor, top_scores: Tensor, score_apply: str) -> Tensor:
    """``score_apply='pre'``: each routed row times its score (in fp32, back to the input's dtype)."""
    if score_apply != "pre":
        return routed_input
    return (routed_input.float() * top_scores.reshape(-1, 1)).to(routed_input.dtype)


def _plan_from_counts(counts: Tensor, ep_size: int, num_local_experts: int, ep_group: Any) -> SplitPlan:
    """Exchange the ``[ep_size, E_local]`` count matrix once; per-rank splits are its row sums on both sides."""
    send = counts.to(torch.int32).reshape(-1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=ep_group)
    received = received.view(ep_size, num_local_experts)
    input_splits, output_splits = torch.stack((send.view(ep_size, -1).sum(1), received.sum(1))).tolist()
    return SplitPlan(input_splits, output_splits, received.sum(dim=0), received)


def compute_split_plan(selected_experts: Tensor, num_experts: int, ep_size: int, num_local_experts: int,
                       ep_group: Any, num_tokens_per_expert: Tensor | None = None) -> SplitPlan:
    """The all-to-all splits for routing ``selected_experts`` (``num_tokens_per_expert``: the router's histogram,
    recomputed when not given). Collective over ``ep_group`` when ``ep_size > 1``."""
    counts = num_tokens_per_expert
    if counts is None:
        counts = count_tokens_per_expert(selected_experts, num_experts)
    if ep_size == 1:
        rows = selected_experts.numel()
        return SplitPlan([rows], [rows], counts, counts.view(1, num_local_experts))
    return _plan_from_counts(counts, ep_size, num_local_experts, ep_group)


def compute_split_plan_from_expert_indices(expert_indices: Tensor, num_experts: int, ep_size: int,
                                           num_local_experts: int, ep_group: Any) -> SplitPlan:
    """:func:`compute_split_plan` for a flat list of routed assignments (one expert id per row)."""
    return compute_split_plan(expert_indices, num_experts, ep_size, num_local_experts, ep_group)


def combine_from_routed(expert_output: Tensor, top_scores: Tensor, token_indices_sorted: Tensor, top_k: int,
                        score_apply: str, combine_impl: str, shape: tuple[int, int, int]) -> Tensor:
    """Expert outputs (rows in expert order; row ``i`` is choice ``token_indices_sorted[i]`` of the flat
    ``[T * k]`` choices) back to tokens: ``[B, S, H]``, each token's ``k`` outputs summed, weighted by its
    scores unless they were applied before the experts."""
    bsz, seqlen, hdim = shape
    tokens = bsz * seqlen
    routed = expert_output.new_zeros(tokens * top_k, hdim)
    routed[token_indices_sorted] = expert_output
    routed = routed.view(tokens, top_k, hdim)
    if score_apply == "post":
        weights = top_scores.reshape(tokens, top_k).float()
        if combine_impl == "legacy_bmm":
            out = torch.bmm(weights.unsqueeze(1), routed.float()).squeeze(1)
        else:
            out = (routed.float() * weights.unsqueeze(-1)).sum(dim=1)
        out = out.to(expert_output.dtype)
    else:
        out = routed.sum(dim=1)
    return out.reshape(bsz, seqlen, hdim)


def _copy_parameter_data(target: nn.Parameter, source: Tensor) -> None:
    """``target`` takes ``source``'s full value, dtype and device (source must be gathered if ZeRO-3)."""
    full_shape = torch.Size(getattr(source, "ds_shape", source.shape))
    if source.data.shape != full_shape:
        raise RuntimeError(f"AutoEP: source parameter must be gathered before copying: expected full shape "
                           f"{tuple(full_shape)}, got {tuple(source.data.shape)}")
    with torch.no_grad():
        target.data = source.data.detach().clone()


def _mark(params: Any, **attrs: Any) -> None:
    for param in params:
        for key, value in attrs.items():
            setattr(param, key, value)


class AutoEPMoELayer(nn.Module):
    """Drop-in replacement for a detected MoE block: ``forward(hidden_states [B, S, H]) -> [B, S, H]`` (and the
    router logits too, for families whose block returns them)."""

    _is_autoep_layer = True

    def __init__(self, spec: MoELayerSpec, source_module: nn.Module, ep_size: int, ep_rank: int,
                 config: AutoEPConfig) -> None:
        super().__init__()
        if spec.num_experts % ep_size or not 0 <= ep_rank < ep_size:
            raise ValueError(f"AutoEP layer '{spec.moe_module_name}': ep_size={ep_size} must divide num_experts="
                             f"{spec.num_experts} and 0 <= ep_rank={ep_rank} < ep_size")
        resolved = resolve_autoep_config_defaults(config, spec.model_family)
        if not spec.supports_expert_bias and resolved.load_balance_coeff is not None:
            raise ValueError(f"AutoEP preset '{spec.model_family}' does not support load_balance_coeff/expert_bias; "
                             f"set expert_parallel.load_balance_coeff to null (got {resolved.load_balance_coeff!r})")
        self.spec = spec
        self.model_family = spec.model_family
        self.return_router_logits = spec.return_router_logits
        self.router_logits_capture_target = spec.router_logits_capture_target
        self.router_logits_capture_index = spec.router_logits_capture_index
        self.router_logits_capture_mode = spec.router_logits_capture_mode
        self.moe_output_shape = spec.moe_output_shape
        self.top_k = spec.top_k
        self.score_apply = resolve_score_apply_mode(spec, config.score_apply)
        self.combine_impl = resolve_combine_impl(config.combine_impl)
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_experts = spec.num_experts
        self.num_local_experts = spec.num_experts // ep_size
        self.hidden_size = spec.hidden_size
        self.ep_group_name = f"ep_size_{ep_size}"
        self.ep_group: Any = None  # bound by set_deepspeed_parallelism()
        self.folding_group_handles: Any = None  # AutoEP folded onto AutoTP (ds_moe.autoep.folded)
        self.tp_group: Any = None
        self.validate_folding_routing = bool(resolved.validate_folding_routing)
        # Mixtral's multiplicative input jitter in training, drawn as its block draws it
        self.jitter_noise = float(getattr(source_module, "jitter_noise", 0.0) or 0.0)
        route_norm = spec.route_norm if config.route_norm is None else bool(config.route_norm)
        source_router = getattr(source_module, spec.router_name)
        self.router = self._build_router(spec, source_router, route_norm)
        alias = spec.router_logits_capture_layer_name or spec.router_name
        if spec.router_logits_capture_target == "router" and alias != "router" and "." not in alias \
                and alias not in ("experts", "shared_experts") and not hasattr(self, alias):
            setattr(self, alias, self.router)  # the block's router name keeps working (same module)

        source_experts = getattr(source_module, spec.experts_name)
        weights = repack_expert_weights(source_experts, spec, ep_rank, ep_size)
        flags = repack_expert_requires_grad_flags(source_experts, spec, ep_rank, ep_size)
        self.experts = GroupedExperts(spec.hidden_size, spec.ffn_hidden_size, self.num_local_experts,
                                      use_grouped_mm=config.use_grouped_mm,
                                      disable_triton_grouped_mm=config.disable_triton_grouped_mm)
        for param, value, flag in zip((self.experts.w1, self.experts.w2, self.experts.w3), weights, flags, strict=True):
            _copy_parameter_data(param, value)
            param.requires_grad_(flag)
        self.shared_experts = getattr(source_module, spec.shared_experts_name, None) \
            if spec.has_shared_experts else None
        self.shared_experts_gate = getattr(source_module, spec.shared_experts_gate_name, None) \
            if spec.shared_experts_gate_name else None

        _mark(self.experts.parameters(), allreduce=False, group_name=self.ep_group_name,
              ds_zero_placement_family="autoep_expert", ds_zero_partition_group_name=self.ep_group_name)
        for module in (self.router, self.shared_experts, self.shared_experts_gate):
            if module is not None:
                _mark(module.parameters(), allreduce=True, ds_zero_placement_family="replicated")
        self.load_balance_coeff = resolved.load_balance_coeff
        self.expert_bias = None  # expert-bias load balancing is refused above and by the config
        device = self.router.gate.weight.device
        self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts, device=device), persistent=False)
        # ids of the replaced source expert parameters -> their replacements, to remap parameter lists and
        # optimizers built before the conversion (ids only: the full source weights can be freed)
        self.replaced_param_ids = {id(p): list(self.experts.parameters()) for p in source_experts.parameters()}
        counterparts = {"weight": self.router.gate.weight, "bias": self.router.gate.bias,
                        "e_score_correction_bias": self.router.e_score_correction_bias}
        for name, param in source_router.named_parameters(recurse=False):
            new = counterparts.get(name)
            self.replaced_param_ids[id(param)] = [new] if isinstance(new, nn.Parameter) else []
        self._cached_router_logits: Tensor | None = None
        if spec.router_logits_capture_target == "router" or spec.return_router_logits:
            self.router.gate.register_forward_hook(self._cache_router_logits)

    @staticmethod
    def _build_router(spec: MoELayerSpec, source: nn.Module, route_norm: bool) -> TokenChoiceTopKRouter:
        bias = getattr(source, "bias", None)
        correction = getattr(source, "e_score_correction_bias", None)
        extra = [getattr(source, name, None) for name in spec.unsupported_router_bias_names]
        router = TokenChoiceTopKRouter(spec.hidden_size, spec.num_experts, spec.num_expert_groups,
                                       spec.num_limited_groups, spec.top_k, spec.score_func, route_norm,
                                       spec.route_scale, spec.gate_bias, spec.group_score_func)
        with gather_source_zero_params([source.weight, bias, correction, *extra]):
            for name, value in zip(spec.unsupported_router_bias_names, extra, strict=True):
                if isinstance(value, Tensor) and torch.count_nonzero(value.detach()).item():
                    raise ValueError(f"AutoEP preset '{spec.model_family}' does not support a nonzero router bias "
                                     f"'{name}'")
            _copy_parameter_data(router.gate.weight, source.weight)
            router.gate.weight.requires_grad_(source.weight.requires_grad)
            if spec.gate_bias and bias is not None:
                _copy_parameter_data(router.gate.bias, bias)
                router.gate.bias.requires_grad_(bias.requires_grad)
            # DeepSeek-V3's selection bias: a parameter in some Transformers builds, a buffer in others
            if isinstance(correction, nn.Parameter):
                router.e_score_correction_bias = nn.Parameter(correction.data.clone(),
                                                              requires_grad=correction.requires_grad)
            elif isinstance(correction, Tensor):
                del router.e_score_correction_bias
                router.register_buffer("e_score_correction_bias", correction.detach().clone())
        return router

    def _cache_router_logits(self, module: nn.Module, inputs: Any, logits: Tensor) -> None:
        if self.router_logits_capture_mode == "post_score":
            score = torch.sigmoid if self.router.score_func == "sigmoid" else (lambda t: torch.softmax(t, dim=-1))
            logits = score(logits.float()).to(logits.dtype)
        self._cached_router_logits = logits

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  folding_group_handles: Any = None) -> None:
        """Create (once per size) the ``ep_size_<n>`` groups and bind this layer's expert-parallel group; with
        ``folding_group_handles`` (a ``FoldingGroupHandles``) bind its expert and tensor-parallel groups instead."""
        if folding_group_handles is not None:
            self._bind_folding(folding_group_handles)
            return
        if self.folding_group_handles is not None:
            return  # folded: the engine's plain setup call keeps the folded groups
        if not (dist.is_available() and dist.is_initialized()):
            if self.ep_size > 1:
                raise RuntimeError(f"AutoEP with autoep_size={self.ep_size} needs torch.distributed initialised")
            return
        if self.ep_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        group = groups._get_expert_parallel_group(self.ep_group_name)
        rank = dist.get_rank(group=group)
        if rank != self.ep_rank:
            raise RuntimeError(f"AutoEP layer '{self.spec.moe_module_name}' holds the experts of expert-parallel "
                               f"rank {self.ep_rank}, but this process is rank {rank} of {self.ep_group_name}")
        self.ep_group = group

    def _bind_folding(self, handles: Any) -> None:
        if handles.spec.ep_size != self.ep_size:
            raise ValueError(f"AutoEP layer '{self.spec.moe_module_name}' has ep_size={self.ep_size}, the folding "
                             f"handles are for autoep_size={handles.spec.ep_size}")
        rank = dist.get_rank(group=handles.ep_group)
        if rank != self.ep_rank:
            raise RuntimeError(f"AutoEP layer '{self.spec.moe_module_name}' holds the experts of expert-parallel "
                               f"rank {self.ep_rank}, but this process is rank {rank} of {handles.ep_group_name}")
        self.folding_group_handles, self.tp_group = handles, handles.tp_group
        self.ep_group, self.ep_group_name = handles.ep_group, handles.ep_group_name

    def _dispatch(self, routed_input: Tensor, router: RouterOutput, expert_ids: Tensor) -> Tensor:
        """Expert outputs for ``routed_input`` (rows sorted by global expert), in the same order."""
        if self.ep_size == 1:
            return self._compute(routed_input, router.num_tokens_per_expert)
        if self.ep_group is None:
            raise RuntimeError(f"AutoEP layer (ep_size={self.ep_size}) has no expert-parallel group: call "
                               "set_deepspeed_parallelism() (deepspeed.initialize does) first")
        plan = compute_split_plan(expert_ids, self.num_experts, self.ep_size, self.num_local_experts, self.ep_group,
                                  num_tokens_per_expert=router.num_tokens_per_expert)
        arrived = _AllToAllV.apply(self.ep_group, routed_input, plan.input_splits, plan.output_splits)
        computed = self._compute(arrived, plan.local_counts_by_source)
        return _AllToAllV.apply(self.ep_group, computed, plan.output_splits, plan.input_splits)

    def _compute(self, rows: Tensor, counts: Tensor) -> Tensor:
        """The local experts on ``rows`` (laid out as ``counts``, ``[E_local]`` or ``[ep, E_local]``), regrouped
        and padded per expert for the grouped GEMM, and put back in the same order."""
        grouped, indices, aligned_counts, n_rows = permute_by_local_expert(rows, counts)
        return unpermute_by_local_expert(self.experts(grouped, aligned_counts), indices, n_rows)

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        shape = hidden_states.shape
        hdim = shape[-1]
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        x = hidden_states.reshape(-1, hdim)
        router = RouterOutput(*self.router(x, self.expert_bias))
        with torch.no_grad():
            self.tokens_per_expert.add_(router.num_tokens_per_expert)
        order = torch.argsort(router.selected_experts.reshape(-1), stable=True)
        scores_sorted = router.top_scores.reshape(-1).index_select(0, order)
        routed_input = apply_scores_before_experts_if_enabled(x.index_select(0, order // self.top_k), scores_sorted,
                                                              self.score_apply)
        if self.folding_group_handles is not None and self.folding_group_handles.spec.tp_size > 1:
            output = folded_expert_combine(self, routed_input, router, order, scores_sorted).reshape(1, -1, hdim)
        else:
            expert_output = self._dispatch(routed_input, router,
                                           router.selected_experts.reshape(-1).index_select(0, order))
            output = combine_from_routed(expert_output, router.top_scores, order, self.top_k, self.score_apply,
                                         self.combine_impl, (1, x.shape[0], hdim))
        if self.moe_output_shape == "flat":
            output = output.reshape(-1, hdim)
        else:
            output = output.reshape(shape)
        if self.shared_experts is not None:
            flat_input = self.moe_output_shape == "flat" or self.shared_experts_gate is not None
            shared_input = x if flat_input else hidden_states
            shared = self.shared_experts(shared_input)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(self.shared_experts_gate(shared_input)) * shared
            output = output + shared.reshape_as(output)
        logits, self._cached_router_logits = self._cached_router_logits, None
        if self.return_router_logits:
            return output, logits
        return output

"""DeepSpeed's gradient/weight norm helpers of ``deepspeed.runtime.utils`` (Megatron's model-parallel rule).

With an ``mpu``, each rank holds part of the model: per-rank sums of ``|x|^p`` are summed (max for the inf-norm)
over ``mpu.get_model_parallel_group()``, and a parameter another rank already counts is left out by the rule of
``ds_zero.grad_norm.counts_in_norm`` (a tied weight's ``ds_pipe_replicated`` copy; replicated, non-sliced
parameters on tensor-slice ranks > 0). The same rule decides the engine's clipping norm, so the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.utils import groups
from ds_zero.grad_norm import LOCAL, NormScope, counts_in_norm, is_model_parallel_parameter, norm_scope

INF = math.inf


def _params(parameters: Any) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _comm_device(group: Any, fallback: torch.device) -> torch.device:
    """Where a scalar for a collective over ``group`` must live (NCCL needs the current CUDA device)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def _all_reduce(value: torch.Tensor, group: Any, op: Any) -> torch.Tensor:
    """``value`` reduced over ``group`` (a copy on the group's device, moved back)."""
    buf = value.to(_comm_device(group, value.device), copy=True)
    dist.all_reduce(buf, op=op, group=group)
    return buf.to(value.device)


def _scope(mpu: Any) -> NormScope:
    return LOCAL if mpu is None else norm_scope(mpu)


def _powered_sum(tensors: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``sum_i ||t_i||_p ^ p`` (fp64 accumulation of fp32 norms), or the max of ``|t|`` for ``p = inf``; a sparse
    tensor counts by its stored values."""
    tensors = [t.detach().coalesce().values() if t.is_sparse else t for t in tensors]
    if norm_type == INF:
        maxima = [t.detach().abs().max().float().to(device) for t in tensors if t.numel()]
        return torch.stack(maxima).max().double() if maxima else torch.zeros((), dtype=torch.float64, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        if t.numel():
            norm = torch.linalg.vector_norm(t.detach(), norm_type, dtype=torch.float32)
            total += norm.to(device).double() ** norm_type
    return total


def tensors_norm(tensors: Sequence[torch.Tensor], norm_type: float, scope: NormScope,
                 device: torch.device) -> torch.Tensor:
    """The p-norm of ``tensors`` on every rank of ``scope`` (0-dim fp64 tensor on ``device``)."""
    norm_type = float(norm_type)
    total = _powered_sum(tensors, norm_type, device)
    if scope.spans_ranks:
        op = dist.ReduceOp.MAX if norm_type == INF else dist.ReduceOp.SUM
        total = _all_reduce(total, scope.group, op)
    return total if norm_type == INF else total ** (1.0 / norm_type)


def _float_or_minus_one(total: torch.Tensor) -> float:
    value = float(total)
    return value if math.isfinite(value) else -1


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def _counted(parameters: Sequence[torch.Tensor], scope: NormScope) -> list[torch.Tensor]:
    return [p for p in parameters if counts_in_norm(p, scope)]


def has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """Whether ``x`` holds an inf or nan, as a 0-dim bool tensor on ``x``'s device (no host sync; ``bool()`` it).

    Reduces to two scalars (``amax`` propagates nan and shows +inf, ``amin`` shows -inf) instead of an elementwise
    mask; a sparse tensor is checked on its stored values, an empty one holds none.
    """
    if x.is_sparse:
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    return torch.isfinite(x.amax()).logical_and(torch.isfinite(x.amin())).logical_not()


def is_invalid_grad_norm(norm: Any) -> bool:
    """Whether a norm is the overflow marker: inf, nan or negative (the -1 that norm helpers return)."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def get_global_norm(norm_list: Iterable[Any]) -> float:
    """The L2 norm of several norms, ``sqrt(sum(n ** 2))``; inf when any of them is invalid (inf, nan, -1)."""
    norms = list(norm_list)
    if any(is_invalid_grad_norm(n) for n in norms):
        return float("inf")
    return math.sqrt(sum(float(n) ** 2.0 for n in norms))


def combine_grad_norm_groups(norm_groups: Iterable[Any], norm_type: float = 2) -> torch.Tensor:
    """The ``norm_type``-norm of per-group norms (tensors or numbers); inf when any group norm is invalid, so the
    -1 overflow marker is never squared into a healthy-looking 1."""
    norms = list(norm_groups)
    device = next((n.device for n in norms if torch.is_tensor(n)), None)
    stacked = torch.stack([n if torch.is_tensor(n) else torch.tensor(n, dtype=torch.float, device=device)
                           for n in norms])
    invalid = (~torch.isfinite(stacked) | (stacked < 0)).any()
    combined = torch.linalg.vector_norm(stacked, ord=norm_type)
    return torch.where(invalid, torch.full_like(combined, float("inf")), combined)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2, mpu: Any = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so their global ``norm_type``-norm is at most ``max_norm``;
    returns the norm before clipping (a 0-dim fp32 tensor).

    As ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``, capped at 1), with the norm
    taken over ``mpu``'s model-parallel group (counting rule above; without an mpu every gradient counts, as in
    DeepSpeed) and averaged over the data-parallel group (DeepSpeed's MoE rule;
    equal gradients give the same norm on every replica).
    """
    params = [p for p in _params(parameters) if p.grad is not None]
    if not params:
        return torch.zeros((), dtype=torch.float32)
    scope = _scope(mpu)
    counted = params if mpu is None or float(norm_type) == INF else _counted(params, scope)
    grads = [p.grad for p in counted]
    device = params[0].grad.device
    total = tensors_norm(grads, norm_type, scope, device).float()
    if dist.is_available() and dist.is_initialized():
        group = groups._get_data_parallel_group()
        total = _all_reduce(total / float(dist.get_world_size(group=group)), group, dist.ReduceOp.SUM)
    clip_coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            p.grad.mul_(clip_coef.to(p.grad.device))  # on the gradient itself: a sparse one's .data is a copy
    return total


def get_grad_norm(parameters: Any, norm_type: float = 2, mpu: Any = None) -> float:
    """The global ``norm_type``-norm of the gradients (model-parallel counting rule); -1 when inf or nan."""
    params = [p for p in _params(parameters) if p.grad is not None]
    scope = _scope(mpu)
    chosen = params if float(norm_type) == INF else _counted(params, scope)
    grads = [p.grad for p in chosen]
    return _float_or_minus_one(tensors_norm(grads, norm_type, scope, _device_of(grads)))


def get_flattened_grad_norm(parameters: Any, norm_type: float = 2, mpu: Any = None,
                            grad_norm_mask: Sequence[torch.Tensor] | None = None) -> float:
    """The global norm of (flat) gradients, summed over ``mpu``'s model-parallel group; ``grad_norm_mask[i]``
    (rows ``[start, end)``, shape ``(k, 2)``) are element ranges of gradient ``i`` left out. -1 when inf or nan."""
    params = [p for p in _params(parameters) if p.grad is not None]
    grads = []
    for i, p in enumerate(params):
        grad = p.grad.detach()
        if grad_norm_mask is not None and norm_type != INF and len(grad_norm_mask[i]) > 0:
            grad = grad.clone()
            for start, end in grad_norm_mask[i].tolist():
                grad[start:end] = 0
        grads.append(grad)
    return _float_or_minus_one(tensors_norm(grads, norm_type, _scope(mpu), _device_of(grads)))


def get_weight_norm(parameters: Any, norm_type: float = 2, mpu: Any = None) -> float:
    """The global ``norm_type``-norm of the parameters themselves (same counting rule); -1 when inf or nan."""
    params = _params(parameters)
    scope = _scope(mpu)
    chosen = params if float(norm_type) == INF else _counted(params, scope)
    data = [p.data for p in chosen]
    return _float_or_minus_one(tensors_norm(data, norm_type, scope, _device_of(data)))


def get_grad_zeros(parameters: Any, mpu: Any = None) -> float:
    """The number of zero gradient elements, counted once across the model-parallel group."""
    params = [p for p in _params(parameters) if p.grad is not None]
    scope = _scope(mpu)
    device = _device_of([p.grad for p in params])
    zeros = torch.zeros((), dtype=torch.float64, device=device)
    for p in _counted(params, scope):
        zeros += p.grad.numel() - torch.count_nonzero(p.grad).to(device)
    if mpu is not None and scope.spans_ranks:
        zeros = _all_reduce(zeros, scope.group, dist.ReduceOp.SUM)
    return float(zeros)


def mask_nan_or_inf_with_val_inplace(input: torch.Tensor, device: Any = None, val: float = -1.0) -> None:  # noqa: A002
    """Replace inf/nan elements of ``input`` by ``val`` (DeepSpeed's overflow marker -1)."""
    input.masked_fill_(~torch.isfinite(input), val)


def get_global_norm_of_tensors(input_tensors: Sequence[torch.Tensor], norm_type: float = 2, mpu: Any = None,
                               moe_ep_group: Any = None) -> torch.Tensor:
    """The norm of ``input_tensors`` (all counted) over ``mpu``'s model-parallel group and ``moe_ep_group``;
    a 0-dim fp32 tensor on the first input's device, -1 when inf or nan."""
    if not all(torch.is_tensor(t) for t in input_tensors):
        raise TypeError("get_global_norm_of_tensors: expected a list of tensors only")
    device = _device_of(input_tensors)
    total = tensors_norm(list(input_tensors), norm_type, _scope(mpu), device)
    if moe_ep_group is not None and dist.get_world_size(moe_ep_group) > 1:
        powered = total if float(norm_type) == INF else total ** float(norm_type)
        op = dist.ReduceOp.MAX if float(norm_type) == INF else dist.ReduceOp.SUM
        powered = _all_reduce(powered, moe_ep_group, op)
        total = powered if float(norm_type) == INF else powered ** (1.0 / float(norm_type))
    total = total.float()
    mask_nan_or_inf_with_val_inplace(total)
    return total


def clip_tensors_by_global_norm(input_tensors: Sequence[torch.Tensor], max_norm: float = 1.0, global_norm: Any = None,
                                mpu: Any = None, eps: float = 1e-6) -> Any:
    """Scale ``input_tensors`` in place when their global norm exceeds ``max_norm``; returns that norm."""
    if global_norm is None:
        global_norm = get_global_norm_of_tensors(input_tensors, mpu=mpu)
    clip_coef = max_norm / (global_norm + eps)
    if clip_coef < 1:
        for t in input_tensors:
            t.detach().mul_(clip_coef)
    return global_norm


def _is_moe_param(param: torch.Tensor) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def _expert_group() -> Any:
    """The largest expert-parallel group (DeepSpeed's choice: it spans every smaller one's ranks)."""
    if groups._get_max_expert_size() is None:
        raise RuntimeError("CheckOverflow: expert parameters (allreduce=False) are checked, but no expert-parallel "
                           "group exists; create them first (MoE layers do at engine start, or "
                           "deepspeed.utils.groups._create_expert_and_data_parallel(ep_size))")
    return groups._get_max_expert_parallel_group()


class CheckOverflow:
    """Whether any gradient holds inf/nan on any rank that shares the step (DeepSpeed's fp16 overflow check).

    The verdict is max-reduced over ``mpu``'s model-parallel group (plus the data-parallel group when the engine
    ``deepspeed`` does not all-reduce gradients in backward), or over the world with ``zero_reduce_scatter``.
    When any checked parameter is an expert's (``allreduce=False``) it is first max-reduced over the largest
    expert-parallel group, as in DeepSpeed: each rank holds other experts, so an inf in one rank's expert must
    skip the step on every rank that steps with it.
    """

    def __init__(self, param_groups: Any = None, mpu: Any = None, zero_reduce_scatter: bool = False,
                 deepspeed: Any = None) -> None:
        self.mpu = mpu
        self.params: list[torch.Tensor] | None = [p for group in param_groups for p in group] if param_groups else None
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.has_moe_params = any(_is_moe_param(p) for p in self.params or ())

    def check_using_norm(self, norm_group: Sequence[float], reduce_overflow: bool = True) -> bool:
        """Overflow when any norm is invalid (inf, nan, the -1 marker), on any model-parallel rank (and any
        expert-parallel rank when there are expert parameters)."""
        flag = torch.tensor([float(any(is_invalid_grad_norm(n) for n in norm_group))])
        if dist.is_available() and dist.is_initialized():
            if self.has_moe_params:
                flag = _all_reduce(flag, _expert_group(), dist.ReduceOp.MAX)
            if self.mpu is not None:
                flag = _all_reduce(flag, self.mpu.get_model_parallel_group(), dist.ReduceOp.MAX)
            elif reduce_overflow:
                flag = _all_reduce(flag, None, dist.ReduceOp.MAX)
        return bool(flag[0].item())

    def check(self, param_groups: Any = None) -> bool:
        if param_groups is None:
            if self.params is None:
                raise ValueError("CheckOverflow.check: no param_groups given here or at construction")
            return self.has_overflow(self.params, has_moe_params=self.has_moe_params)
        params = [p for group in param_groups for p in group]
        return self.has_overflow(params, has_moe_params=any(_is_moe_param(p) for p in params))

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        return any(p.grad is not None and bool(self._has_inf_or_nan(p.grad.data, i)) for i, p in enumerate(params))

    def _backward_allreduce_off(self) -> bool:
        engine = self.deepspeed
        if engine is None:
            return False
        if hasattr(engine, "pipeline_enable_backward_allreduce"):
            return engine.pipeline_enable_backward_allreduce is False
        return getattr(engine, "enable_backward_allreduce", True) is False

    def has_overflow(self, params: Iterable[torch.Tensor], has_moe_params: bool | None = None) -> bool:
        if has_moe_params is None:
            has_moe_params = self.has_moe_params
        flag = torch.tensor([float(self.has_overflow_serial(params))])
        if not (dist.is_available() and dist.is_initialized()):
            return bool(flag[0].item())
        if has_moe_params:
            flag = _all_reduce(flag, _expert_group(), dist.ReduceOp.MAX)
        if self.zero_reduce_scatter:
            flag = _all_reduce(flag, None, dist.ReduceOp.MAX)
        elif self.mpu is not None:
            if self._backward_allreduce_off():
                flag = _all_reduce(flag, self.mpu.get_data_parallel_group(), dist.ReduceOp.MAX)
            flag = _all_reduce(flag, self.mpu.get_model_parallel_group(), dist.ReduceOp.MAX)
        elif self._backward_allreduce_off():
            flag = _all_reduce(flag, None, dist.ReduceOp.MAX)
        return bool(flag[0].item())

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor, i: int | None = None) -> torch.Tensor:
        return has_inf_or_nan(x)


__all__ = ["CheckOverflow", "clip_grad_norm_", "clip_tensors_by_global_norm", "combine_grad_norm_groups",
           "get_flattened_grad_norm", "get_global_norm", "get_global_norm_of_tensors", "get_grad_norm",
           "get_grad_zeros", "get_weight_norm", "has_inf_or_nan", "is_invalid_grad_norm", "is_model_parallel_parameter",
           "mask_nan_or_inf_with_val_inplace", "tensors_norm"]

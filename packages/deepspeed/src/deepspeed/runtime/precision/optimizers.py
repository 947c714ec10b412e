"""Stage-0 optimizer wrappers (``OptimizerWrapper``): fp32, and fp16/bf16 with fp32 master weights.

``FP32Optimizer`` updates the model's own parameters (also used for ``torch_autocast``, whose weights stay
fp32; with an fp16 autocast dtype it carries a loss scaler like ``torch.amp.GradScaler``).
``MixedPrecisionOptimizer`` keeps an fp32 master copy of every fp16/bf16 parameter inside the torch
optimizer, updates the masters and copies them back. With ``grad_accum_dtype=float32`` (bf16) each
micro-step's low-precision gradient is added into an fp32 buffer as it lands, so accumulation over many
micro-steps does not round in bf16.

With model parallelism (``norm_scope`` from the mpu: pipeline stages, tensor slices) the clipping norm is the
norm over every model-parallel rank's gradients (ds-zero's ``counts_in_norm`` rule) and an overflow on one
rank makes every rank of the model-parallel and data-parallel groups skip the step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.runtime.precision.loss_scalers import DynamicLossScaler, StaticLossScaler
from ds_zero.grad_norm import LOCAL, NormScope, counts_in_norm, model_parallel_norm
from ds_zero.loss_scaled import LossScaledWrapper
from ds_zero.registry import register_masters

Scaler = StaticLossScaler | DynamicLossScaler | None


def global_norm(grads: list[torch.Tensor]) -> float:
    """L2 norm over every tensor in ``grads`` (fp32 arithmetic); inf/nan when any element is."""
    if not grads:
        return 0.0
    dense = [g.coalesce().values() if g.is_sparse else g for g in grads]
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in dense], 2.0)
    return float(torch.linalg.vector_norm(torch.stack(norms), 2.0))


def _agree_on_overflow(overflow: bool, group: Any) -> bool:
    """Every rank skips the step if any rank overflowed (ranks' gradients may differ under no_sync)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return overflow
    flag = torch.tensor([1.0 if overflow else 0.0])
    if dist.get_backend(group) == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def _summed_square(local_norm: float, group: Any) -> float:
    """``local_norm ** 2`` summed over ``group`` (inf/nan on any rank stays inf/nan)."""
    square = torch.tensor([local_norm ** 2], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        square = square.cuda()
    dist.all_reduce(square, group=group)
    return float(square)


class FP32Optimizer(LossScaledWrapper, torch.optim.Optimizer):
    """Updates the model's parameters in place with ``optimizer``; optional loss scaling and clipping.

    A ``torch.optim.Optimizer`` by type (not by construction: everything is the wrapped optimizer's), because
    DeepSpeed's fp32 ZeRO-0 ``engine.optimizer`` *is* the client's torch optimizer and clients test for that
    (``isinstance(engine.optimizer, torch.optim.Optimizer)``, torch's LR schedulers)."""

    grads_in_params = True
    """Gradients live in ``param.grad`` (the reducer may point them at its buckets, see ``runtime.grad_reduce``)."""
    plain_state_dict = True
    """Without loss scaling the checkpoint holds the wrapped optimizer's own state dict, as DeepSpeed's does."""

    def __init__(self, optimizer: torch.optim.Optimizer, clip: float = 0.0, loss_scaler: Scaler = None,
                 dp_group: Any = None, check_overflow: bool = False, norm_scope: NormScope = LOCAL) -> None:
        self.optimizer = optimizer
        self.clip = float(clip)
        self.loss_scaler = loss_scaler
        self.dp_group = dp_group
        self.norm_scope = norm_scope
        self.check_overflow = check_overflow or loss_scaler is not None
        self.global_grad_norm: float | None = None
        self.overflow = False
        self.expert_norm_groups: dict[str, Any] = {}
        """MoE: expert group name -> its expert-parallel group (set by the MoE setup): each expert rank holds
        other experts, so their squares are summed over that group, as DeepSpeed's norm with MoE layers."""

    # ---- the engine's view (loss_scale, cur_scale, scales_loss, param_groups, state: LossScaledWrapper) ----
    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """The gradient stays in ``param.grad``: nothing to do."""

    def get_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def set_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        param.grad = grad.to(param.dtype)

    def grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return param.dtype

    # ---- the update ---------------------------------------------------------------------------------
    def _hp_params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _hp_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model parameter, its fp32 gradient) for the optimizer's parameters that have one."""
        return [(p, p.grad) for p in self._hp_params() if p.grad is not None]

    def _grad_norm(self, pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> float:
        """The norm over every model-parallel rank (this rank's alone without model parallelism); a gradient
        left out (another rank counts it) that is inf/nan still makes the norm nan (an overflow)."""
        counted, left_out, experts = [], [], {}
        for p, g in pairs:
            if not counts_in_norm(p, self.norm_scope):
                left_out.append(g)
            elif getattr(p, "allreduce", True) is False and p.group_name in self.expert_norm_groups:
                experts.setdefault(p.group_name, []).append(g)
            else:
                counted.append(g)
        norm = global_norm(counted)
        if experts:
            norm = math.sqrt(norm ** 2 + sum(_summed_square(global_norm(grads), self.expert_norm_groups[name])
                                             for name, grads in sorted(experts.items())))
        if left_out and not math.isfinite(global_norm(left_out)):
            norm = math.nan
        return model_parallel_norm(norm, self.norm_scope)

    def _after_update(self) -> None:
        """Hook for wrappers that keep a separate copy of the weights."""

    def step(self) -> bool:
        """Unscale, skip on overflow (agreed across ranks), clip to ``clip`` (global norm), update."""
        pairs = self._hp_grads()
        grads = [g for _, g in pairs]
        need_norm = self.check_overflow or self.clip > 0
        # the model-parallel sum makes an overflow on any stage/slice non-finite on all; then the data-parallel MAX
        norm = self._grad_norm(pairs) / self.loss_scale if need_norm else None
        overflow = self.check_overflow and _agree_on_overflow(norm is None or not math.isfinite(norm), self.dp_group)
        if self._skip_on_overflow(overflow):
            return False
        self.global_grad_norm = norm
        coef = self._grad_coef(norm, self.clip)
        if coef != 1.0 and grads:
            dense = [g for g in grads if not g.is_sparse]
            if dense:
                torch._foreach_mul_(dense, coef)
            for g in grads:
                if g.is_sparse:
                    g.mul_(coef)
        self.optimizer.step()
        self._after_update()
        return self._stepped()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def sync_master_from_model(self) -> None:
        """The model's parameters are the master weights: nothing to refresh."""

    # ---- checkpoint state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.loss_scaler is None and self.plain_state_dict:  # as DeepSpeed's fp32 stage 0: the wrapped
            # optimizer's own state dict
            return self.optimizer.state_dict()
        state = {"optimizer_state_dict": self.optimizer.state_dict()}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Either form: the wrapped optimizer's own state dict (DeepSpeed's, ours since) or ours wrapped in
        ``optimizer_state_dict`` (with ``loss_scaler``)."""
        if "optimizer_state_dict" not in state_dict:
            self.optimizer.load_state_dict(state_dict)
            return
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        if self.loss_scaler is not None and "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


class MixedPrecisionOptimizer(FP32Optimizer):
    """fp16/bf16 model parameters, fp32 master weights inside ``optimizer`` (its param_groups are re-pointed).

    ``fp32_grad_accum``: accumulate micro-step gradients in an fp32 buffer per parameter (bf16 with
    ``data_types.grad_accum_dtype = fp32``) instead of in the parameter's own ``.grad``.
    """

    plain_state_dict = False  # the masters ride along: always our wrapped form

    def __init__(self, optimizer: torch.optim.Optimizer, clip: float = 0.0, loss_scaler: Scaler = None,
                 dp_group: Any = None, check_overflow: bool = False, fp32_grad_accum: bool = False,
                 norm_scope: NormScope = LOCAL) -> None:
        super().__init__(optimizer, clip, loss_scaler, dp_group, check_overflow, norm_scope)
        self.fp32_grad_accum = fp32_grad_accum
        self.model_params: list[torch.nn.Parameter] = []
        self.master_of: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                master = torch.nn.Parameter(p.detach().to(torch.float32).clone())
                self.model_params.append(p)
                self.master_of[p] = master
                masters.append(master)
            group["params"] = masters
        optimizer.state.clear()  # state keyed by the low-precision tensors would no longer match
        register_masters(optimizer, self.master_of)  # deepspeed.utils.safe_* reach the masters (as BF16_Optimizer)

    @property
    def grads_in_params(self) -> bool:  # type: ignore[override]
        return not self.fp32_grad_accum

    def _accumulates(self, param: torch.nn.Parameter) -> bool:
        """True when ``param``'s gradient lives in its master's fp32 buffer (params outside the optimizer: no)."""
        return self.fp32_grad_accum and param in self.master_of

    def on_grad(self, param: torch.nn.Parameter) -> None:
        if not self._accumulates(param) or param.grad is None:
            return
        master = self.master_of[param]
        if master.grad is None:
            master.grad = param.grad.to(torch.float32)
        else:
            master.grad.add_(param.grad)
        param.grad = None  # the fp32 buffer holds it now; the next micro-step's grad starts fresh

    def get_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return self.master_of[param].grad if self._accumulates(param) else param.grad

    def set_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        if self._accumulates(param):
            self.master_of[param].grad = grad.to(torch.float32)
        else:
            param.grad = grad.to(param.dtype)

    def grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return torch.float32 if self._accumulates(param) else param.dtype

    def _hp_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(model parameter, its master's fp32 gradient): the model parameter carries the attributes that
        decide whether it counts in the norm (``ds_pipe_replicated``, ``model_parallel``)."""
        if not self.fp32_grad_accum:
            for p in self.model_params:
                master = self.master_of[p]
                master.grad = None if p.grad is None else p.grad.to(torch.float32)
        return [(p, self.master_of[p].grad) for p in self.model_params if self.master_of[p].grad is not None]

    def _after_update(self) -> None:
        masters = [self.master_of[p] for p in self.model_params]
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.model_params], [m.data for m in masters])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
            master = self.master_of[p]
            if set_to_none or master.grad is None:
                master.grad = None
            else:
                master.grad.zero_()

    def sync_master_from_model(self) -> None:
        with torch.no_grad():
            for p in self.model_params:
                self.master_of[p].data.copy_(p.data)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["fp32_master_weights"] = [self.master_of[p].detach() for p in self.model_params]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        saved = state_dict.get("fp32_master_weights")
        if saved is None:
            self.sync_master_from_model()
            return
        if len(saved) != len(self.model_params):
            raise ValueError(f"optimizer state: {len(saved)} fp32 master weights saved, this model has "
                             f"{len(self.model_params)} trainable parameters")
        with torch.no_grad():
            for p, weights in zip(self.model_params, saved, strict=True):
                self.master_of[p].data.copy_(weights)
                p.data.copy_(weights)

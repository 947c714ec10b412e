"""The ZeRO-3 optimizer wrapper: partitioned 16-bit (or fp32) weights, fp32 masters, gradients and optimizer
states; the engine's ``OptimizerWrapper`` for ``zero_optimization.stage: 3``.

Each optimizer parameter group becomes a :class:`Z3Group`: the partitions (``ds_tensor``) of its parameters
become views of one flat low-precision buffer (``lp_flat``, DeepSpeed's ``fp16_partitioned_groups_flat``), this
rank's fp32 master is one flat tensor of the same layout (``master``, DeepSpeed's ``fp32_flat_groups``, on the
CPU with ``offload_optimizer``), and so is the gradient partition that the reduce-scatter adds into. The wrapped
torch optimizer steps the masters (one flat tensor per group, so any elementwise optimizer and per-group
hyper-parameters and LR schedules keep working). A step: global norm across partitions (one scalar
all-reduce; inf/nan is an overflow on every rank) -> unscale and clip -> update -> write the new values into
the partitions -> gather the persistent parameters again (the others are gathered when next used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_zero._grad_norm import partitioned_norm
from ds_zero._loss_scaled import LossScaledWrapper
from ds_zero._reduce import ReduceSettings
from ds_zero._registry import register
from ds_zero.collectives import TORCH, Collectives
from ds_zero.partition import Fragment
from ds_zero.zero3._reduce_scatter import ReduceScatter
from ds_zero.zero3._schedule import ParamScheduler


@dataclass(frozen=True)
class Zero3Settings:
    """Resolved ``zero_optimization`` options (and precision options) the ZeRO-3 optimizer needs."""

    reduce: ReduceSettings = field(default_factory=ReduceSettings)
    clip: float = 0.0
    check_overflow: bool = False
    fp32_grad_accum: bool = False
    offload_optimizer: bool = False
    pin_memory: bool = False
    load_from_fp32_weights: bool = True
    sub_group_size: int = 1_000_000_000


class Z3Layout:
    """Where a group's parameters sit in every rank's flat partition (the stage 1/2 ``FlatLayout`` questions,
    answered for per-parameter partitioning)."""

    def __init__(self, params: list[torch.nn.Parameter], offsets: list[int], world: int) -> None:
        self.params, self.offsets, self.world = params, offsets, world

    def owners(self, index: int) -> list[tuple[int, Fragment]]:
        p = self.params[index]
        part = p.ds_tensor.numel()
        out = []
        for rank in range(self.world):
            start = rank * part
            numel = min(part, p.ds_numel - start)
            if numel > 0:
                out.append((rank, Fragment(index, start, self.offsets[index], start, numel)))
        return out


class Z3Group:
    """One optimizer parameter group's partitions; ``params`` and ``names`` in flat order."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], grad_dtype: torch.dtype,
                 master_device: torch.device, pin_memory: bool) -> None:
        self.params, self.names = params, names
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.ds_tensor.numel()
        self.numel = total
        first = params[0].ds_tensor if params else torch.empty(0)
        self.lp_flat = torch.empty(total, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, offset in zip(params, self.offsets, strict=True):
                view = self.lp_flat.narrow(0, offset, p.ds_tensor.numel())
                view.copy_(p.ds_tensor)
                view.ds_numel = view.numel()
                p.ds_tensor = view
        if first.dtype == torch.float32 and first.device == master_device and not pin_memory:
            # fp32 training without optimizer offload: the fp32 partitions are the masters (a copy would make the
            # model states 20 instead of 16 bytes per parameter, over N ranks)
            master = self.lp_flat.detach()
        else:
            master = self.lp_flat.detach().to(master_device, torch.float32, copy=True)
            if pin_memory and master.device.type == "cpu" and torch.cuda.is_available():
                master = master.pin_memory()
        self.master = torch.nn.Parameter(master)
        self.grad_dtype, self.grad_device = grad_dtype, first.device
        self.grad = torch.zeros(total, dtype=grad_dtype, device=first.device)
        self.index = {id(p): i for i, p in enumerate(params)}
        space = params[0].ds_space if params else None
        self.rank = space.rank if space is not None else 0
        self.layout = Z3Layout(params, self.offsets, space.world if space is not None else 1)

    @property
    def grad_partition(self) -> torch.Tensor:
        return self.grad

    grad_partition_allocated = True

    def repoint(self) -> None:
        """``lp_flat`` moved (``offload_states``): the partitions become views of its new storage again."""
        flat = self.lp_flat.detach()
        for p, offset in zip(self.params, self.offsets, strict=True):
            view = flat.narrow(0, offset, p.ds_tensor.numel())
            view.ds_numel = view.numel()
            p.ds_tensor = view

    def grad_slice(self, param: torch.nn.Parameter) -> torch.Tensor:
        i = self.index[id(param)]
        return self.grad.narrow(0, self.offsets[i], param.ds_tensor.numel())

    def master_slice(self, param: torch.nn.Parameter) -> torch.Tensor:
        i = self.index[id(param)]
        return self.master.detach().narrow(0, self.offsets[i], param.ds_tensor.numel())

    def _shares_master(self) -> bool:  # checked at each use: offload_states may move one of the two apart
        return self.master.detach().data_ptr() == self.lp_flat.detach().data_ptr()

    def copy_master_to_lp(self) -> None:
        if self._shares_master():
            return
        with torch.no_grad():
            self.lp_flat.copy_(self.master.detach(), non_blocking=self.master.is_pinned())

    def sync_master_from_lp(self) -> None:
        if self._shares_master():
            return
        with torch.no_grad():
            self.master.data.copy_(self.lp_flat)

    def fp32_grad(self) -> torch.Tensor:
        if self.grad.dtype == torch.float32 and self.grad.device == self.master.device:
            return self.grad
        return self.grad.to(self.master.device, torch.float32)


def _sub_groups(params: list[torch.nn.Parameter], size: int) -> list[list[torch.nn.Parameter]]:
    out, current, total = [], [], 0
    for p in params:
        current.append(p)
        total += p.ds_tensor.numel()
        if total >= size:
            out.append(current)
            current, total = [], 0
    if current or not out:
        out.append(current)
    return out


def is_ds_cpu_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    from ds_zero.stage_1_and_2 import is_ds_cpu_optimizer as check

    return check(optimizer)


class DeepSpeedZeroOptimizer_Stage3(LossScaledWrapper):  # noqa: N801 (DeepSpeed's class name)
    """ZeRO stage 3 wrapper around ``init_optimizer`` (a torch optimizer over the model's partitioned parameters).

    ``scheduler``: the :class:`ParamScheduler` of the partitioned model; ``names``: parameter -> name;
    ``params``: the trainable parameters in model order.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                 names: dict[torch.nn.Parameter, str], scheduler: ParamScheduler, settings: Zero3Settings,
                 loss_scaler: Any = None, dp_group: Any = None, comm: Collectives = TORCH) -> None:
        self.optimizer = init_optimizer
        self.scheduler = scheduler
        self.settings = settings
        self.loss_scaler = loss_scaler
        self.dp_group = dp_group
        self.comm = comm
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(dp_group) if distributed else 1
        self.rank = dist.get_rank(dp_group) if distributed else 0
        self.global_grad_norm: float | None = None
        self.overflow = False
        self._cpu_adam = settings.offload_optimizer and is_ds_cpu_optimizer(init_optimizer)
        self.groups = self._build_groups(names)
        self.home = {p: (gi, i) for gi, g in enumerate(self.groups) for i, p in enumerate(g.params)}
        self._group_of = {id(p): g for g in self.groups for p in g.params}
        low = params[0].dtype if params else torch.float32
        comm_dtype = settings.reduce.comm_dtype or low
        self.reducer = ReduceScatter(params, self._add_grad, settings.reduce, comm, dp_group, self.world,
                                     self.rank, comm_dtype, scheduler.end_pass)
        scheduler.ends_with_backward = True
        register(self, [p for g in self.groups for p in g.params])

    def _build_groups(self, names: dict[torch.nn.Parameter, str]) -> list[Z3Group]:
        """One :class:`Z3Group` per sub-group: each optimizer parameter group is cut into runs of about
        ``sub_group_size`` partition elements (DeepSpeed's sub-groups), each with its own flat master, so the
        step's temporary fp32 copies stay bounded; the torch group holds the sub-groups' masters."""
        s = self.settings
        groups, seen = [], set()
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in params)
            bad = [tuple(p.shape) for p in params if p not in names or not hasattr(p, "ds_id")]
            if bad:
                raise ValueError(f"ZeRO-3: optimizer parameters of shapes {bad[:5]} are not partitioned parameters "
                                 "of the model (pass the model's own parameters to the optimizer)")
            masters = []
            for chunk in _sub_groups(params, max(1, s.sub_group_size)):
                low = chunk[0].dtype if chunk else torch.float32
                grad_dtype = torch.float32 if s.fp32_grad_accum else low
                device = chunk[0].ds_tensor.device if chunk else torch.device("cpu")
                master_device = torch.device("cpu") if s.offload_optimizer else device
                zg = Z3Group(chunk, [names[p] for p in chunk], grad_dtype, master_device, s.pin_memory)
                masters.append(zg.master)
                groups.append(zg)
            group["params"] = masters
        self.optimizer.state.clear()
        return groups

    def _add_grad(self, param: torch.nn.Parameter, averaged: torch.Tensor) -> None:
        group = self._group_of.get(id(param))
        if group is not None:
            group.grad_slice(param).add_(averaged)

    # ---- the engine's view ----------------------------------------------------------------------------------
    partition_gradients = True

    def on_grad(self, param: torch.nn.Parameter) -> None:
        if hasattr(param, "ds_id"):
            self.scheduler.grad_landed(param)

    def get_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def set_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        param.grad = grad.to(param.dtype)

    def grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return param.dtype

    # ---- the step -------------------------------------------------------------------------------------------
    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        return partitioned_norm(grads, self.comm, self.dp_group, self.world)

    def step(self) -> bool:
        grads = [g.fp32_grad() for g in self.groups]
        norm = self._global_norm(grads) / self.loss_scale
        if self._skip_on_overflow(self.settings.check_overflow and not math.isfinite(norm)):
            return False
        self.global_grad_norm = norm
        coef = self._grad_coef(norm, self.settings.clip)
        for g, grad in zip(self.groups, grads, strict=True):
            if coef != 1.0:
                grad.mul_(coef)  # the gradient partition is cleared right after the step
            g.master.grad = grad
        if self._cpu_adam:
            self.optimizer.step(fp16_param_groups=[[g.lp_flat] for g in self.groups])
        else:
            self.optimizer.step()
            for g in self.groups:
                g.copy_master_to_lp()
        for g in self.groups:
            g.master.grad = None
        self.partitions_changed()
        return self._stepped()

    def partitions_changed(self) -> None:
        """The partitions were rewritten: whole values still around are stale."""
        self.scheduler.release_all()
        self.scheduler.refresh_persistent()

    def refresh_master(self, param: torch.nn.Parameter) -> None:
        """The partition of ``param`` was modified by hand (``GatheredParameters(modifier_rank=...)``): make the
        fp32 master follow it."""
        group = self._group_of.get(id(param))
        if group is not None:
            with torch.no_grad():
                group.master_slice(param).copy_(param.ds_tensor)

    def group_of(self, param: torch.nn.Parameter) -> Z3Group:
        return self._group_of[id(param)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            g.grad.zero_()
            for p in g.params:
                p.grad = None
        self.reducer.reset()

    def sync_master_from_model(self) -> None:
        for g in self.groups:
            g.sync_master_from_lp()

    # ---- checkpoint state (DeepSpeed's stage 3 optimizer state dict) ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        from ds_zero.zero3.checkpoint import stage3_state_dict

        return stage3_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """This rank's saved state (same world size), or every saved rank's state (a list, any world size: the
        partitions are cut again by parameter name)."""
        from ds_zero.zero3.checkpoint import load_stage3_state

        load_stage3_state(self, state_dict if isinstance(state_dict, list) else [state_dict])
        self.partitions_changed()

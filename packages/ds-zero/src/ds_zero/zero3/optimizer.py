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

ZeRO-Infinity (``offload_optimizer.device: nvme``): the first ``ratio`` of the sub-groups keep master, gradient
partition and optimizer states in ``ds_zero.swap.OptimizerSwapper``'s files; their gradients are written there
as they arrive (with their squared norms kept for clipping) and the step streams them through the swapper's
buffers one sub-group at a time. Partitions on NVMe (``offload_param.device: nvme``) have no flat buffer: the
updated values are written through to their swap files.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_zero.collectives import TORCH, Collectives
from ds_zero.grad_norm import partitioned_norm
from ds_zero.host_pinning import TORCH_PINNING, HostPinning, PinnedBuffers
from ds_zero.loss_scaled import LossScaledWrapper
from ds_zero.muon import ZeroMuon
from ds_zero.registry import register
from ds_zero.stage_1_and_2 import ReduceSettings
from ds_zero.swap.param_swapper import is_swapped
from ds_zero.zero3.expert_groups import PartitionGroupQueries, build_reducer, split_by_space
from ds_zero.zero3.leaf import leaf_parameters
from ds_zero.zero3.param import partition_copy
from ds_zero.zero3.parameter_offload import DeepSpeedZeRoOffload
from ds_zero.zero3.schedule import ParamScheduler
from ds_zero.zero3.sub_group import Z3Group, Z3Layout, sub_groups

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "Z3Group", "Z3Layout", "Zero3Settings", "is_ds_cpu_optimizer"]


@dataclass(frozen=True)
class Zero3Settings:
    """Resolved ``zero_optimization`` options (and precision options) the ZeRO-3 optimizer needs."""

    reduce: ReduceSettings = field(default_factory=ReduceSettings)
    clip: float = 0.0
    check_overflow: bool = False
    fp32_grad_accum: bool = False
    offload_optimizer: bool = False
    pin_memory: bool = False
    host_pinning: HostPinning = TORCH_PINNING  # how pin_memory pins (ds_zero.host_pinning)
    load_from_fp32_weights: bool = True
    sub_group_size: int = 1_000_000_000
    optimizer_swap: Any = None  # ds_zero.swap.OptimizerSwapSettings: offload_optimizer.device nvme


def is_ds_cpu_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    from ds_zero.stage_1_and_2 import is_ds_cpu_optimizer as check

    return check(optimizer)


class DeepSpeedZeroOptimizer_Stage3(PartitionGroupQueries, LossScaledWrapper):  # noqa: N801 (DeepSpeed's class name)
    """ZeRO stage 3 wrapper around ``init_optimizer`` (a torch optimizer over the model's partitioned parameters).

    ``scheduler``: the :class:`ParamScheduler` of the partitioned model; ``names``: parameter -> name;
    ``params``: the trainable parameters in model order.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                 names: dict[torch.nn.Parameter, str], scheduler: ParamScheduler, settings: Zero3Settings,
                 loss_scaler: Any = None, dp_group: Any = None, comm: Collectives = TORCH) -> None:
        self.optimizer = init_optimizer
        self.scheduler = scheduler
        self.parameter_offload = DeepSpeedZeRoOffload(scheduler)  # DeepSpeed's hook API (TRL's generation path)
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
        self.swapper: Any = None  # ZeRO-Infinity's OptimizerSwapper; ``swapped``: the sub-groups it holds
        self.swapped: list[int] = []
        self._pinned = PinnedBuffers(settings.host_pinning)  # offloaded masters, freed by destroy()
        self.groups = self._build_groups(names)
        if self.swapper is not None:
            self.swapper.init_masters((i, self.groups[i].initial_master) for i in self.swapped)
            for i in self.swapped:
                self.swapper.prepare_grad(i, self.groups[i].numel)
            scheduler.on_remove.append(self.close_swap)
        self._swap_index = {id(self.groups[i]): i for i in self.swapped}
        self._muon = ZeroMuon.for_stage3(self)  # Muon groups: updates from full gradients (ds_zero.muon)
        self.home = {p: (gi, i) for gi, g in enumerate(self.groups) for i, p in enumerate(g.params)}
        self.leaf_parameters = leaf_parameters(self.home)  # leaf module -> its trainable parameters (DeepSpeed's)
        self._group_of = {id(p): g for g in self.groups for p in g.params}
        low = params[0].dtype if params else torch.float32
        comm_dtype = settings.reduce.comm_dtype or low
        self.reducer = build_reducer(params, self._add_grad, settings.reduce, comm, dp_group, self.world,
                                     self.rank, comm_dtype, scheduler.end_pass)
        scheduler.ends_with_backward = True
        register(self, [p for g in self.groups for p in g.params])

    def destroy(self) -> None:
        """Free the host buffers pinned for CPU offload now rather than when collected (``engine.destroy()``
        calls it, as DeepSpeed's does); the optimizer must not step afterwards."""
        self._pinned.release()

    def quantize_nontrainable_params(self) -> int:
        """DeepSpeed's call after freezing parameters (ZeRO++ ``zero_quantized_nontrainable_weights``)."""
        return self.parameter_offload.quantize_nontrainable_params()

    def _build_groups(self, names: dict[torch.nn.Parameter, str]) -> list[Z3Group]:
        """One :class:`Z3Group` per sub-group: each optimizer parameter group is cut into runs of about
        ``sub_group_size`` partition elements (DeepSpeed's sub-groups), each with its own flat master, so the
        step's temporary fp32 copies stay bounded; the torch group holds the sub-groups' masters."""
        s = self.settings
        chunks, seen = [], set()
        for gi, group in enumerate(self.optimizer.param_groups):
            params = [p for p in group["params"] if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in params)
            bad = [tuple(p.shape) for p in params if p not in names or not hasattr(p, "ds_id")]
            if bad:
                raise ValueError(f"ZeRO-3: optimizer parameters of shapes {bad[:5]} are not partitioned parameters "
                                 "of the model (pass the model's own parameters to the optimizer)")
            for run in split_by_space(params) or [params]:  # a sub-group's partitions share one partition group
                chunks += [(gi, chunk) for chunk in sub_groups(run, max(1, s.sub_group_size))]
        self._plan_swap(chunks)
        groups, masters = [], [[] for _ in self.optimizer.param_groups]
        for i, (gi, chunk) in enumerate(chunks):
            low = chunk[0].dtype if chunk else torch.float32
            grad_dtype = torch.float32 if s.fp32_grad_accum else low
            device = chunk[0].ds_tensor.device if chunk else torch.device("cpu")
            if device.type == "meta":  # partitions on NVMe: swapped in to CPU memory
                device = torch.device("cpu")
            master_device = torch.device("cpu") if s.offload_optimizer or s.optimizer_swap else device
            zg = Z3Group(chunk, [names[p] for p in chunk], grad_dtype, master_device, s.pin_memory,
                         master_on_nvme=i in self.swapped, pinned=self._pinned)
            masters[gi].append(zg.master)
            groups.append(zg)
        for group, ms in zip(self.optimizer.param_groups, masters, strict=True):
            group["params"] = ms
        self.optimizer.state.clear()
        return groups

    def _plan_swap(self, chunks: list[tuple[int, list[torch.nn.Parameter]]]) -> None:
        """ZeRO-Infinity: the last ``ratio`` of the sub-groups keep master and states on NVMe, counted as
        DeepSpeed does (sub-group ``i`` of ``n`` is offloaded when ``i >= int((1 - ratio) * n)``: any ratio above
        0 offloads at least one)."""
        swap = self.settings.optimizer_swap
        if swap is None:
            return
        from ds_zero.swap import OptimizerSwapper
        from ds_zero.swap.from_config import global_rank

        ratio = float(swap.ratio)
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"zero_optimization.offload_optimizer.ratio={ratio}: accepted is a fraction in [0, 1]")
        first = int((1.0 - ratio) * len(chunks))
        self.swapped = list(range(first, len(chunks)))
        if not self.swapped:
            return
        largest = max((sum(p.ds_tensor.numel() for p in chunks[i][1]) for i in self.swapped), default=1)
        self.swapper = OptimizerSwapper(swap, global_rank(), largest)

    def _add_grad(self, param: torch.nn.Parameter, averaged: torch.Tensor) -> None:
        group = self._group_of.get(id(param))
        if group is None:
            return
        if group.master_on_nvme:
            self._add_swapped_grad(group, param, averaged)
        else:
            group.grad_slice(param).add_(averaged)

    def _add_swapped_grad(self, group: Z3Group, param: torch.nn.Parameter, averaged: torch.Tensor) -> None:
        """Write (or, accumulating, read-add-write) the parameter's gradient partition in its sub-group's
        gradient file, keeping its squared norm for the step's global norm."""
        i, k = self._swap_index[id(group)], group.index[id(param)]
        offset = group.offsets[k]
        value = averaged.detach().reshape(-1).to(torch.float32)
        if k in group.grad_written:
            value = self.swapper.read_grad(i, offset, value.numel()).add_(value)
        group.grad_written[k] = float(torch.linalg.vector_norm(value, 2.0)) ** 2
        self.swapper.write_grad(i, offset, value)

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

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """DeepSpeed's per-sub-group gradient norms over every data-parallel rank (loss-scaled, as DeepSpeed's are;
        a collective). A sub-group whose gradients went to NVMe enters through the squared norms kept as written."""
        return [torch.tensor(self._global_norm(
            [torch.tensor([math.sqrt(sum(g.grad_written.values()))])] if g.master_on_nvme else [g.fp32_grad()]))
            for g in self.groups]

    @property
    def _global_grad_norm(self) -> torch.Tensor | None:  # DeepSpeed's name for the last step's norm (a tensor)
        return None if self.global_grad_norm is None else torch.tensor(self.global_grad_norm)

    def step(self) -> bool:
        if self.swapper is not None:
            return self._swapped_step()
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
        if self._muon is not None:
            self._muon.apply(grads)
        self._update(self.groups)
        for g in self.groups:
            g.master.grad = None
        self.partitions_changed()
        return self._stepped()

    def _update(self, groups: list[Z3Group]) -> None:
        """Step the masters of ``groups`` (their ``grad`` set; every other master has none) and write the new
        values into the partitions. DeepSpeedCPUAdam writes them in the same pass (its fused copy) when every
        sub-group has a flat CPU buffer. The swapped step calls this once per sub-group, so a master on NVMe
        goes through the very kernel call that one in memory does: the fused-copy and plain kernels may round
        the update differently, and NVMe offload must equal CPU offload bit for bit."""
        lp = {id(g.master): g.lp_flat for g in self.groups}  # per torch group: its sub-groups' partitions
        if self._cpu_adam and all(t is not None for t in lp.values()):
            self.optimizer.step(fp16_param_groups=[[lp[id(m)] for m in pg["params"]]
                                                   for pg in self.optimizer.param_groups])
            return
        self.optimizer.step()  # partitions on NVMe (no flat buffer) are written through by copy_master_to_lp
        for g in groups:
            g.copy_master_to_lp()

    def _swapped_step(self) -> bool:
        """ZeRO-Infinity's step: the in-memory sub-groups step together, then the swapped ones stream through
        the swapper's buffers one at a time (each reads its master and states, steps, writes them back)."""
        swapped_sumsq = sum(s for g in self.groups for s in g.grad_written.values())
        # fp32 sums without fp32 copies; the swapped gradients enter as one element holding their norm
        norm = self._global_norm([g.grad for g in self.groups if not g.master_on_nvme]
                                 + [torch.tensor([math.sqrt(swapped_sumsq)])]) / self.loss_scale
        if self._skip_on_overflow(self.settings.check_overflow and not math.isfinite(norm)):
            return False
        self.global_grad_norm = norm
        coef = self._grad_coef(norm, self.settings.clip)
        swapped = set(self.swapped)
        resident = [g for i, g in enumerate(self.groups) if i not in swapped]
        for g in resident:
            g.master.grad = self._scaled_grad(g, coef)
        if resident:
            self._update(resident)
        for g in resident:
            g.master.grad = None

        def one(i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            g = self.groups[i]
            grad = tensors.pop("grad")
            for k, (p, offset) in enumerate(zip(g.params, g.offsets, strict=True)):
                if k not in g.grad_written:  # no gradient this window: what the file holds is an older one
                    grad.narrow(0, offset, p.ds_tensor.numel()).zero_()
            self._attach(g, tensors)
            g.master.grad = grad.mul_(coef) if coef != 1.0 else grad
            self._update([g])
            g.master.grad = None
            return self._detach(g)

        self.swapper.run(self.swapped, one)
        self.partitions_changed()
        return self._stepped()

    @staticmethod
    def _scaled_grad(g: Z3Group, coef: float) -> torch.Tensor:
        grad = g.fp32_grad()
        return grad.mul_(coef) if coef != 1.0 else grad  # the gradient partition is cleared after the step

    def _attach(self, g: Z3Group, tensors: dict[str, torch.Tensor]) -> None:
        """A swapped sub-group's master and optimizer states (read from NVMe) become the live ones."""
        g.master.data = tensors["master"]
        state = self.optimizer.state[g.master]
        for name, value in tensors.items():
            if name != "master":
                state[name] = value

    def _detach(self, g: Z3Group) -> dict[str, torch.Tensor]:
        """The tensors of a swapped sub-group to write back (master, and every per-element fp32 state, new ones
        included); they leave the optimizer, which keeps only its scalars (Adam's ``step``) in memory."""
        master = g.master.detach()
        keep = {"master": master}
        state = self.optimizer.state.get(g.master, {})
        for name, value in list(state.items()):
            if name != "step" and isinstance(value, torch.Tensor) and value.dtype == torch.float32 \
                    and value.numel() == master.numel() and value.dim() == 1:
                keep[name] = state.pop(name)
        g.master.data = torch.empty(0, dtype=torch.float32)
        return keep

    @contextlib.contextmanager
    def materialized(self, write_back: bool, ids: Iterable[int] | None = None) -> Iterator[None]:
        """The master and states of the swapped sub-groups ``ids`` (default: all) in memory for the duration (a
        checkpoint save or load, a debug read or write); ``write_back``: what they hold afterwards goes back to
        NVMe. Whatever happens inside, every sub-group attached is detached again (its memory released)."""
        if self.swapper is None:
            yield
            return
        attached: list[int] = []
        try:
            for i in self.swapped if ids is None else ids:
                self._attach(self.groups[i], self.swapper.read_new(i))
                attached.append(i)
            yield
        finally:
            for i in attached:
                keep = self._detach(self.groups[i])
                if write_back:
                    self.swapper.write_now(i, keep)

    @contextlib.contextmanager
    def grads_materialized(self, ids: Iterable[int], write_back: bool) -> Iterator[None]:
        """The gradient partitions of the swapped sub-groups ``ids`` in memory (as their ``grad``) for the
        duration: a debug read or write of gradients. ``write_back``: they go back to their files, and every
        parameter of the sub-group then counts as having a gradient (zeros where it had none: the same step)."""
        loaded: list[int] = []
        try:
            for i in ids:
                g = self.groups[i]
                grad = self.swapper.read_grad(i, 0, g.numel)
                for k, (p, offset) in enumerate(zip(g.params, g.offsets, strict=True)):
                    if k not in g.grad_written:  # what the file holds there is an older window's gradient
                        grad.narrow(0, offset, p.ds_tensor.numel()).zero_()
                g.grad = grad
                loaded.append(i)
            yield
        finally:
            for i in loaded:
                g = self.groups[i]
                grad, g.grad = g.grad, torch.zeros(0, dtype=g.grad_dtype, device=g.grad_device)
                if write_back:
                    self.swapper.write_grad(i, 0, grad.to(torch.float32))
                    for k, (p, offset) in enumerate(zip(g.params, g.offsets, strict=True)):
                        part = grad.narrow(0, offset, p.ds_tensor.numel()).to(torch.float32)
                        g.grad_written[k] = float(torch.linalg.vector_norm(part, 2.0)) ** 2

    def swapped_sub_groups(self, params: Iterable[torch.nn.Parameter]) -> list[int]:
        """The sub-groups on NVMe that hold any of ``params`` (what :meth:`materialized` needs for them)."""
        swapped = set(self.swapped)
        return sorted({self.home[p][0] for p in params if p in self.home and self.home[p][0] in swapped})

    def close_swap(self) -> None:
        """Delete this optimizer's swap files and buffers (engine destroy; also done at exit)."""
        if self.swapper is not None:
            self.swapper.close()

    def partitions_changed(self) -> None:
        """The partitions were rewritten: whole values still around are stale."""
        self.scheduler.release_all()
        self.scheduler.refresh_persistent()

    def refresh_master(self, param: torch.nn.Parameter) -> None:
        """The partition of ``param`` was modified by hand (``GatheredParameters(modifier_rank=...)``): make the
        fp32 master follow it."""
        group = self._group_of.get(id(param))
        if group is None:
            return
        value = partition_copy(param) if is_swapped(param) else param.ds_tensor
        with torch.no_grad():
            if not group.master_on_nvme:
                group.master_slice(param).copy_(value)
                return
            i = self.groups.index(group)  # read, modify and write back the sub-group's master on NVMe
            tensors = self.swapper.read_new(i)
            tensors["master"].narrow(0, group.offsets[group.index[id(param)]], value.numel()).copy_(value)
            self.swapper.write_now(i, tensors)

    def group_of(self, param: torch.nn.Parameter) -> Z3Group:
        return self._group_of[id(param)]

    @property
    def micro_step_id(self) -> int:
        """Gradient reductions into the partitions since the last ``zero_grad`` (DeepSpeed's name): 0 means the
        next one starts the window."""
        return self.reducer.micro_steps

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            g.grad.zero_()
            g.grad_written.clear()
            for p in g.params:
                p.grad = None
        self.reducer.reset()

    def sync_master_from_model(self) -> None:
        with self.materialized(write_back=True):  # masters on NVMe are rewritten from the partitions
            for g in self.groups:
                g.sync_master_from_lp()

    # ---- checkpoint state (DeepSpeed's stage 3 optimizer state dict) ----------------------------------------
    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """DeepSpeed's name for each sub-group's flat fp32 master partition."""
        return [g.master for g in self.groups]

    @property
    def fp16_partitioned_groups_flat(self) -> list[torch.Tensor | None]:
        """DeepSpeed's name for each sub-group's flat low-precision partition (None where it is on NVMe)."""
        return [g.lp_flat for g in self.groups]

    @property
    def fp16_groups(self) -> list[list[torch.nn.Parameter]]:
        """DeepSpeed's name for the sub-groups' parameters (whatever their dtype)."""
        return [g.params for g in self.groups]

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """DeepSpeed's view of the accumulated gradient partitions: ``[sub-group]`` -> one per parameter."""
        return {i: [g.grad_slice(p) for p in g.params] for i, g in enumerate(self.groups) if g.grad.numel()}

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """This rank's accumulated gradient partitions in fp32, ``[sub-group][index in it]`` (DeepSpeed's)."""
        swapped = self.grads_materialized(self.swapped, write_back=False) if self.swapper is not None \
            else contextlib.nullcontext()
        with swapped:
            return {i: {k: g.grad.narrow(0, offset, p.ds_tensor.numel()).float()
                        for k, (p, offset) in enumerate(zip(g.params, g.offsets, strict=True))}
                    for i, g in enumerate(self.groups)}

    def _set_fp32_optimizer_param_groups(self) -> None:
        """DeepSpeed puts the sub-groups' fp32 masters into the torch optimizer's parameter groups around a step
        or a read of its ``state_dict()`` (its tests and tools call this first); here they stay there from
        construction on, so this only re-establishes that."""
        masters: dict[int, list[torch.nn.Parameter]] = {i: [] for i in range(len(self.optimizer.param_groups))}
        owner = {id(m): i for i, pg in enumerate(self.optimizer.param_groups) for m in pg["params"]}
        for g in self.groups:
            masters[owner.get(id(g.master), 0)].append(g.master)
        for i, group in enumerate(self.optimizer.param_groups):
            group["params"] = masters[i]

    def _clear_fp32_optimizer_param_groups(self) -> None:
        """DeepSpeed empties the parameter groups again after the step or read; this step reads the masters from
        them, so they stay (the torch optimizer's ``state_dict()`` is the same either way)."""

    def state_dict(self) -> dict[str, Any]:
        from ds_zero.zero3.checkpoint import stage3_state_dict

        with self.materialized(write_back=False):  # the checkpoint gathers what is on NVMe
            sd = stage3_state_dict(self)
            base = sd["optimizer_state_dict"]  # torch shares each parameter's live state dict: detach them
            base["state"] = {k: dict(v) for k, v in base["state"].items()}
            return sd

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """This rank's saved state (same world size), or every saved rank's state (a list, any world size: the
        partitions are cut again by parameter name)."""
        from ds_zero.zero3.checkpoint import load_stage3_state

        with self.materialized(write_back=True):
            load_stage3_state(self, state_dict if isinstance(state_dict, list) else [state_dict])
        self.partitions_changed()

"""ZeRO stages 1 and 2: fp32 master weights, optimizer states and (stage 2) gradients partitioned across the
data-parallel group.

:class:`DeepSpeedZeroOptimizer` is the engine's ``OptimizerWrapper``: each optimizer parameter group becomes
one :class:`~ds_zero._flat_group.FlatGroup` (the model's parameters turn into views of a flat buffer, this rank
keeps its partition of fp32 masters and gradients), and the wrapped torch optimizer steps only this rank's
fp32 partition (one flat tensor per group, so any elementwise torch optimizer works and per-group
hyper-parameters and LR schedules keep working). A step: averaged gradient partitions (from the
:class:`~ds_zero._reduce.PartitionedReducer`) -> global norm across partitions (one scalar all-reduce, and one
over the model-parallel group when there is one, leaving out fragments that another rank counts; inf/nan is an
overflow on every rank) -> unscale and clip -> update -> write the new values into the model weights and gather
every rank's partition. With ``offload_optimizer.device = cpu`` the masters and optimizer states
live in CPU memory and ds-ops' ``DeepSpeedCPUAdam`` writes the updated low-precision weights in the same pass.

MoE (``group_comms``): an expert parameter group is partitioned, reduced and gathered over its own process group
(the expert-data-parallel group: each rank owns 1/edp of that group's flat buffer), its sums divided by the whole
data-parallel size, as DeepSpeed's ``real_dp_process_group`` / ``average_tensor`` do. The norm needs no extra
collective: the expert-data-parallel groups split the data-parallel ranks into disjoint sets of experts, each
partitioned once, so the data-parallel sum of squares counts every expert exactly once (DeepSpeed sums over the
data-parallel group too; its ``_average_expert_grad_norms`` then averages equal values).

The memory estimators live in ``ds_zero.estimate`` and are re-exported here, at DeepSpeed's module path.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_zero._flat_group import FlatGroup, GroupComm, param_homes
from ds_zero._reduce import PartitionedReducer, ReduceSettings
from ds_zero.collectives import TORCH, Collectives
from ds_zero.estimate import (  # DeepSpeed's module path for the ZeRO-2 estimators
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)
from ds_zero.estimate import zero2_model_to_params as model_to_params
from ds_zero.gather import gather_method, gather_partitions
from ds_zero.grad_norm import LOCAL, NormScope, counts_in_norm, partition_runs, partitioned_norm
from ds_zero.host_pinning import TORCH_PINNING, HostPinning, PinnedBuffers
from ds_zero.loss_scaled import LossScaledWrapper
from ds_zero.muon import ZeroMuon
from ds_zero.optimizer_state import load_partitioned_state, partitioned_state_dict, universal_checkpoint_info_of
from ds_zero.registry import register

logger = logging.getLogger("DeepSpeed")  # DeepSpeed's logger (deepspeed.utils.logger), by name

__all__ = [
    "DeepSpeedZeroOptimizer",
    "GroupComm",
    "ReduceSettings",
    "ZeroSettings",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "model_to_params",
]


@dataclass(frozen=True)
class ZeroSettings:
    """Resolved ``zero_optimization`` options plus the precision options a ZeRO optimizer needs."""

    stage: int = 1
    reduce: ReduceSettings = field(default_factory=ReduceSettings)
    allgather_bucket_numel: int = 500_000_000
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    load_from_fp32_weights: bool = True
    clip: float = 0.0
    check_overflow: bool = False
    fp32_grad_accum: bool = False
    offload_device: str | None = None
    pin_memory: bool = False
    host_pinning: HostPinning = TORCH_PINNING  # how pin_memory pins (ds_zero.host_pinning)


def is_ds_cpu_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """A ds-ops CPU optimizer, which can write the updated low-precision weights in its own pass."""
    return "fp16_param_groups" in inspect.signature(optimizer.step).parameters


class DeepSpeedZeroOptimizer(LossScaledWrapper):
    """ZeRO stage 1/2 optimizer wrapper around ``init_optimizer`` (a torch optimizer over model parameters).

    ``names``: parameter -> name (for checkpoints); ``params``: the trainable parameters in model order
    (the reducer buckets them in reverse); ``loss_scaler``: an object with ``loss_scale``,
    ``update_scale(overflow)`` and ``state_dict``/``load_state_dict``, or None; ``norm_scope``: the
    model-parallel ranks the gradient norm and overflow verdict span (``ds_zero.grad_norm.norm_scope(mpu)``);
    ``group_comms``: index of a parameter group of ``init_optimizer`` -> the :class:`GroupComm` it is
    partitioned over instead of ``dp_group`` (MoE expert groups: their expert-data-parallel group).
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                 names: dict[torch.nn.Parameter, str], settings: ZeroSettings, loss_scaler: Any = None,
                 dp_group: Any = None, comm: Collectives = TORCH, norm_scope: NormScope = LOCAL,
                 group_comms: Mapping[int, GroupComm] | None = None) -> None:
        self.optimizer = init_optimizer
        self.comm = comm
        self.settings = settings
        self.loss_scaler = loss_scaler
        self.dp_group = dp_group
        self.norm_scope = norm_scope
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(dp_group) if distributed else 1
        self.rank = dist.get_rank(dp_group) if distributed else 0
        self.global_grad_norm: float | None = None
        self.overflow = False
        self._cpu_adam = settings.offload_device == "cpu" and is_ds_cpu_optimizer(init_optimizer)
        self._pinned = PinnedBuffers(settings.host_pinning)  # offloaded masters, freed by destroy()
        self.groups = self._build_groups(names, self._check_group_comms(group_comms or {}))
        self.home = param_homes(self.groups)
        self._norm_runs = [self._partition_norm_runs(fg) for fg in self.groups]
        self._acc: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.reducer = PartitionedReducer(params, self.groups, self.home, self.get_grad, self.grad_dtype,
                                          settings.reduce, dp_group, self.world, settings.stage, comm)
        self._gather = [gather_method(fg.process_group, settings.allgather_partitions) if fg.layout.world_size > 1
                        else "none" for fg in self.groups]
        self._muon = ZeroMuon.for_stage12(self)  # Muon groups: updates from full gradients (ds_zero.muon)
        self.bit16_groups = [list(fg.params) for fg in self.groups]  # DeepSpeed's name: the model's params per group
        self._enable_universal_checkpoint()
        register(self, list(self.home))


    def destroy(self) -> None:
        """Free the host buffers pinned for CPU offload now rather than when collected (``engine.destroy()``
        calls it, as DeepSpeed's does); the optimizer must not step afterwards."""
        self._pinned.release()

    @property
    def _global_grad_norm(self) -> float | None:  # DeepSpeed's name for the last step's norm
        return self.global_grad_norm

    def _enable_universal_checkpoint(self) -> None:
        """Cache the parameters' universal-checkpoint description (saved with the state dict). DeepSpeed also
        binds its fragment loader to each parameter here; this optimizer restores a Universal Checkpoint through
        ``ds_zero.checkpoint``'s ``load_universal`` instead."""
        self._universal_checkpoint_info = universal_checkpoint_info_of(self.bit16_groups)

    def _get_universal_checkpoint_info(self) -> Any:
        return getattr(self, "_universal_checkpoint_info", None)

    def _check_group_comms(self, group_comms: Mapping[int, GroupComm]) -> Mapping[int, GroupComm]:
        count = len(self.optimizer.param_groups)
        for index, gc in group_comms.items():
            if not 0 <= index < count:
                raise ValueError(f"ZeRO: group_comms names parameter group {index}; the optimizer has {count}")
            distributed = dist.is_available() and dist.is_initialized()
            actual = dist.get_world_size(gc.group) if distributed else 1
            if gc.world_size != actual:
                raise ValueError(f"ZeRO: group_comms[{index}].world_size is {gc.world_size}, its process group has "
                                 f"{actual} ranks")
        return group_comms

    def _group_rank(self, gc: GroupComm | None) -> tuple[Any, int, int, float]:
        """``(process group, world size, this rank, gradient divisor)`` of a parameter group."""
        if gc is None:
            return self.dp_group, self.world, self.rank, float(self.world)
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(gc.group) if distributed else 0
        return gc.group, gc.world_size, rank, float(gc.grad_divisor or self.world)

    def _build_groups(self, names: dict[torch.nn.Parameter, str],
                      group_comms: Mapping[int, GroupComm]) -> list[FlatGroup]:
        s = self.settings
        groups = []
        seen: set[torch.nn.Parameter] = set()
        for index, group in enumerate(self.optimizer.param_groups):
            process_group, world, rank, divisor = self._group_rank(group_comms.get(index))
            params = [p for p in group["params"] if p.requires_grad and p not in seen]
            seen.update(params)
            missing = [tuple(p.shape) for p in params if p not in names]
            if missing:
                raise ValueError(f"ZeRO: optimizer parameters of shapes {missing[:5]} are not parameters of the model")
            low = params[0].dtype if params else torch.float32
            # stage 1's partition lives only from the boundary reduction to the step: fp32, so it is the masters'
            # gradient itself rather than a copy converted at the step
            grad_dtype = torch.float32 if s.fp32_grad_accum or s.stage == 1 else low
            device = torch.device("cpu") if s.offload_device == "cpu" else (params[0].device if params else
                                                                              torch.device("cpu"))
            fg = FlatGroup(params, [names[p] for p in params], world, rank, grad_dtype, device,
                           round_robin=s.round_robin_gradients, pin_memory=s.pin_memory,
                           persistent_grads=s.stage >= 2, pinned=self._pinned)
            fg.process_group, fg.grad_divisor = process_group, divisor
            logger.info(f"Flattening param group {index} on " + (f"{fg.lp_flat.device.type} (sufficient memory)"
                        if fg.flattened_on_device else "CPU (insufficient memory)"))
            group["params"] = [fg.master]
            groups.append(fg)
        self.optimizer.state.clear()  # state keyed by the model's tensors would no longer match
        return groups

    # ---- the engine's view ----------------------------------------------------------------------------------
    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """DeepSpeed's name for this rank's fp32 master partition of each parameter group."""
        return [fg.master for fg in self.groups]

    @property
    def bit16_groups_flat(self) -> list[torch.Tensor]:
        """DeepSpeed's name for each parameter group's flat buffer of model weights (the model's parameters are
        views of it; padded to ``2 * world_size`` elements, detached from autograd)."""
        return [fg.lp_flat for fg in self.groups]

    def get_param_id(self, param: torch.nn.Parameter) -> int:
        """DeepSpeed's id of a parameter: its index over ``bit16_groups`` (group by group, in flat order)."""
        g, i = self.home[param]
        return sum(len(fg.params) for fg in self.groups[:g]) + i

    @property
    def param_to_partition_ids(self) -> list[dict[int, list[int]]]:
        """DeepSpeed's map, per group: parameter id -> the ranks whose partitions hold a piece of it."""
        return [{self.get_param_id(p): [rank for rank, _ in fg.layout.owners(i)] for i, p in enumerate(fg.params)}
                for fg in self.groups]

    @property
    def accumulated_grads_in_cpu(self) -> dict[int, torch.Tensor]:
        """DeepSpeed's name (with CPU offload only) for the gradients accumulated over this window's micro-steps,
        keyed by the parameter's index over ``bit16_groups``. Stage 2: the averaged gradient of each parameter this
        rank's partition holds (its owned piece, flattened), read from the gradient partition, where the
        micro-steps accumulate: views when the partition is in CPU memory, else CPU copies (the partition lives
        beside the model; it is not copied to the host and back each micro-step), from the first backward on
        (DeepSpeed fills its buffers only when a window holds more than one backward). Stage 1: the fp32 accumulators
        of low-precision gradients (``data_types.grad_accum_dtype`` fp32) held in CPU memory, alive from a
        parameter's first backward to ``zero_grad``."""
        if self.settings.offload_device != "cpu":
            raise AttributeError("accumulated_grads_in_cpu exists with offload_optimizer.device = cpu only")
        index = {p: i for i, p in enumerate(p for params in self.bit16_groups for p in params)}
        if self.settings.stage == 1:
            return {index[p]: acc for p, acc in self._acc.items() if acc.device.type == "cpu"}
        out: dict[int, torch.Tensor] = {}
        for fg in self.groups:
            partition = fg.grad_partition
            for frag in fg.own:
                piece = partition.narrow(0, frag.partition_offset, frag.numel)
                out[index[fg.params[frag.index]]] = piece if piece.device.type == "cpu" else piece.to("cpu")
        return out

    @property
    def partition_gradients(self) -> bool:
        return self.settings.stage >= 2

    def _accumulates(self, param: torch.nn.Parameter) -> bool:
        """Stage 1 keeps full gradients: with fp32 accumulation they are summed into an fp32 buffer."""
        return self.settings.fp32_grad_accum and self.settings.stage == 1 and param.dtype != torch.float32

    def on_grad(self, param: torch.nn.Parameter) -> None:
        if param.grad is None or param not in self.home:
            return
        if not self._accumulates(param):
            if self.settings.stage == 1 and param.device.type == "cpu":
                self._keep_in_slot(param)
            return
        acc = self._acc.get(param)
        if acc is None:
            self._acc[param] = param.grad.to(torch.float32)
        else:
            acc.add_(param.grad)
        param.grad = None

    def _keep_in_slot(self, param: torch.nn.Parameter) -> None:
        """Stage 1 keeps full gradients until the step: in the reducer's persistent per-bucket stores
        (``PartitionedReducer.grad_slot``), as stage 0's bucket views. A fresh gradient is copied into its slot
        and autograd's tensor freed at once, so its memory serves the next layer's gradient (6,100 page faults
        per step on a 6.3M-parameter MLP when a model's gradients were freed together at ``zero_grad``); later
        micro-steps accumulate into the slot in place, and the reduction sends from it with no second copy.
        CPU only: a device's caching allocator already reuses the memory, and there the gradients' memory must
        go at ``zero_grad`` (``offload_states`` relies on it)."""
        grad = param.grad
        slot = self.reducer.grad_slot(param)
        if slot is None or grad is slot or grad.is_sparse or grad.requires_grad or grad.dtype != slot.dtype:
            return  # (a gradient that requires grad: backward(create_graph=True) builds on it; left as it is)
        if grad.data_ptr() == slot.data_ptr() and grad.stride() == slot.stride():
            return
        slot.copy_(grad)
        param.grad = slot

    def get_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        return self._acc.get(param) if self._accumulates(param) else param.grad

    def set_grad(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        if self._accumulates(param):
            self._acc[param] = grad.to(torch.float32)
        else:
            param.grad = grad.to(param.dtype)

    def grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return torch.float32 if self._accumulates(param) else param.dtype

    # ---- the step -------------------------------------------------------------------------------------------
    def _ensure_partitions(self) -> None:
        """Gradients not reduced into the partitions in this window (one rank; stage 1 under ``no_sync`` at the
        boundary) are taken from the local full gradients."""
        if not self.reducer.reduced:
            for fg in self.groups:
                fg.collect_local_grads([self.get_grad(p) for p in fg.params])
            self.reducer.reduced = True

    def _partition_norm_runs(self, fg: FlatGroup) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
        """``(counted, left out)`` runs of ``fg``'s gradient partition, or None when all of it counts (the
        common case: the whole partition is normed in one call)."""
        counts = [counts_in_norm(p, self.norm_scope) for p in fg.params]
        return None if all(counts) else partition_runs(fg.own, counts)

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        counted: list[torch.Tensor] = []
        left_out: list[torch.Tensor] = []
        for g, runs in zip(grads, self._norm_runs, strict=True):
            if runs is None:
                counted.append(g)
                continue
            counted += [g.narrow(0, start, numel) for start, numel in runs[0]]
            left_out += [g.narrow(0, start, numel) for start, numel in runs[1]]
        return partitioned_norm(counted, self.comm, self.dp_group, self.world, self.norm_scope, left_out)

    def step(self) -> bool:
        """Unscale, skip on overflow (every rank sees the same global norm), clip, update, gather weights."""
        self._ensure_partitions()
        grads = self._step_grads()
        norm = self._global_norm(grads) / self.loss_scale
        if self._skip_on_overflow(self.settings.check_overflow and not math.isfinite(norm)):
            return False
        self.global_grad_norm = norm
        coef = self._grad_coef(norm, self.settings.clip)
        for fg, g in zip(self.groups, grads, strict=True):
            if coef != 1.0:
                g.mul_(coef)
            fg.master.grad = g
        if self._muon is not None:
            self._muon.apply(grads)
        self._update()
        for fg in self.groups:
            fg.master.grad = None
        return self._stepped()

    def _step_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient partitions ``step`` applies, one per group (ZenFlow gives its window's mean)."""
        return [fg.fp32_grad() for fg in self.groups]

    def _update(self) -> None:
        if self._cpu_adam:  # update-and-copy: the kernel writes the new low-precision weights in its pass
            self.optimizer.step(fp16_param_groups=[[fg.lp_partition] for fg in self.groups])
        else:
            self.optimizer.step()
            for fg in self.groups:
                fg.copy_master_to_lp()
        self.all_gather_params()

    def all_gather_params(self) -> None:
        """Give every rank every partition of the updated weights (collective)."""
        for fg, method in zip(self.groups, self._gather, strict=True):
            gather_partitions(self.comm, fg.lp_flat, fg.layout, fg.rank, fg.process_group, method,
                              self.settings.allgather_bucket_numel)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for fg in self.groups:
            fg.clear_grads()
            for p in fg.params:
                p.grad = None
        self._acc.clear()
        self.reducer.reset()

    def sync_master_from_model(self) -> None:
        for fg in self.groups:
            fg.sync_master_from_lp()

    # ---- checkpoint state (DeepSpeed's stage 1/2 optimizer state dict) --------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return partitioned_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Restore from this rank's saved state (same world size), or from every saved rank's state (a list,
        any world size: the fp32 partitions and optimizer states are re-partitioned by parameter name)."""
        load_partitioned_state(self, state_dict if isinstance(state_dict, list) else [state_dict],
                               same_layout=not isinstance(state_dict, list))
        self.all_gather_params()

"""AutoEP folded onto AutoTP (DeepSpeed's ``deepspeed.module_inject.auto_ep_folding``): the layout and the gradient
rules of expert parallelism laid over the tensor-parallel ranks.

Layout (per pipeline stage of ``stage_size = world_size / pp_size`` consecutive ranks):
- tensor-parallel groups: ``tp_size`` consecutive ranks; dense data parallel: one rank per TP lane, stride ``tp_size``;
- expert-parallel groups: ``ep_size`` consecutive ranks (so an EP group may span TP lanes and stay node-local);
- expert-data-parallel groups: the same position in every EP group of the stage.

Every TP peer holds the same tokens (AutoTP's replicated layers), routes them identically, keeps one share of the
routed assignments (``ds_moe.ep_tp_dispatch``) and all-gathers the expert outputs back, so:
- replicated parameters (router, LayerNorm, dense layers left whole) reach the optimizer with lane-dependent
  gradients whose TP average is the true gradient: ``average`` (TP all-reduce, divide by ``tp_size``);
- routed experts get ``tp_size`` times their gradient from the all-gather's backward and are not replicated over
  TP: ``expert_tp_cancel`` (divide by ``tp_size``, no TP collective; the EDP reduction stays with the expert path);
- parameters AutoTP really shards (``tensor_model_parallel``) are reduced by their own path: ``skip``.
``sum`` exists for parameters explicitly marked as token-partitioned partials (none on today's forward path).
Pure topology math unless a caller passes process groups into :class:`FoldingGroupHandles`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

AUTOEP_FOLDING_PARAM_FAMILY_ATTR = "ds_autoep_folding_param_family"
AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM = "router_gate_replicated"
AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM = "router_gate_partial"
AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM = "sp_sharded_layernorm"
AUTOEP_FOLDING_GRAD_CORRECTED_ATTR = "ds_autoep_folding_grad_corrected"
AUTOEP_FOLDING_GRAD_REDUCE_SKIP = "skip"
AUTOEP_FOLDING_GRAD_REDUCE_SUM = "sum"
AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE = "average"
AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL = "expert_tp_cancel"


@dataclass(frozen=True)
class ParallelFoldingSpec:
    """The sizes of one folded layout; ``dp_size = stage_size / tp_size``, ``edp_size = stage_size / (ep * etp)``.
    ``mp_mode``: how the model-parallel lanes split tokens (``tp``: AutoTP; ``sp``: sequence parallel)."""

    world_size: int
    pp_size: int
    stage_size: int
    tp_size: int
    dp_size: int
    ep_size: int
    etp_size: int
    edp_size: int
    mp_mode: str = "tp"


@dataclass(frozen=True)
class FoldingGroupTables:
    """Every group of each kind, as tuples of global ranks."""

    tp_groups: tuple[tuple[int, ...], ...]
    dense_dp_groups: tuple[tuple[int, ...], ...]
    ep_groups: tuple[tuple[int, ...], ...]
    edp_groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class FoldingGroupHandles:
    """One rank's process groups of a folded layout and their rank lists (what an AutoEP layer binds)."""

    spec: ParallelFoldingSpec
    tp_group: Any
    dense_dp_group: Any
    ep_group: Any
    edp_group: Any
    ep_group_name: str
    tp_ranks: tuple[int, ...]
    dense_dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_folding_spec(*, world_size: int, pp_size: int, tp_size: int, ep_size: int, etp_size: int = 1,
                       mp_mode: str = "tp") -> ParallelFoldingSpec:
    """The folded layout of these sizes; ``ValueError`` naming the key and the valid values when they do not tile."""
    for name, value in (("world_size", world_size), ("pp_size", pp_size), ("tensor_parallel.autotp_size", tp_size),
                        ("expert_parallel.autoep_size", ep_size),
                        ("expert_parallel.expert_tensor_parallel_size", etp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % pp_size:
        raise ValueError(f"pp_size={pp_size} must divide world_size={world_size}. Valid pp_size values: "
                         f"{_divisors(world_size)}")
    stage = world_size // pp_size
    where = f"the stage size (world_size={world_size} / pp_size={pp_size} = {stage})"
    if stage % tp_size:
        raise ValueError(f"tensor_parallel.autotp_size={tp_size} must divide {where}, else the data-parallel size is "
                         f"not whole. Valid autotp_size values: {_divisors(stage)}")
    width = ep_size * etp_size
    if stage % width:
        raise ValueError(f"expert_parallel.autoep_size * expert_parallel.expert_tensor_parallel_size ({ep_size} * "
                         f"{etp_size} = {width}) must divide {where}, else the expert-data-parallel size is not "
                         f"whole. Valid expert-width values: {_divisors(stage)}")
    return ParallelFoldingSpec(world_size=world_size, pp_size=pp_size, stage_size=stage, tp_size=tp_size,
                               dp_size=stage // tp_size, ep_size=ep_size, etp_size=etp_size,
                               edp_size=stage // width, mp_mode=mp_mode)


def expected_folding_group_tables(spec: ParallelFoldingSpec) -> FoldingGroupTables:
    """The rank lists of every TP, dense-DP, EP and EDP group (no process group is created)."""
    tp, dense, ep, edp = [], [], [], []
    for first in range(0, spec.world_size, spec.stage_size):
        stage = range(first, first + spec.stage_size)
        tp += [tuple(stage[i:i + spec.tp_size]) for i in range(0, spec.stage_size, spec.tp_size)]
        dense += [tuple(stage[lane::spec.tp_size]) for lane in range(spec.tp_size)]
        blocks = [tuple(stage[i:i + spec.ep_size]) for i in range(0, spec.stage_size, spec.ep_size)]
        ep += blocks
        edp += [tuple(block[pos] for block in blocks) for pos in range(spec.ep_size)]
    return FoldingGroupTables(tuple(tp), tuple(dense), tuple(ep), tuple(edp))


def local_folding_ranks(global_rank: int, spec: ParallelFoldingSpec) -> dict[str, tuple[int, ...]]:
    """The groups holding ``global_rank``: keys ``tp``, ``dense_dp``, ``ep``, ``edp``."""
    if not 0 <= global_rank < spec.world_size:
        raise ValueError(f"global_rank={global_rank} is outside world_size={spec.world_size}")
    tables = expected_folding_group_tables(spec)
    kinds = (("tp", tables.tp_groups), ("dense_dp", tables.dense_dp_groups), ("ep", tables.ep_groups),
             ("edp", tables.edp_groups))
    return {kind: next(group for group in table if global_rank in group) for kind, table in kinds}


def _mpu_size(mpu: Any, *getters: str) -> int | None:
    for getter in getters:
        if mpu is not None and hasattr(mpu, getter):
            return int(getattr(mpu, getter)())
    return None


def validate_folding_global(spec: ParallelFoldingSpec, *, zero_stage: int = 0, sp_size: int = 1,
                            deepcompile_enabled: bool = False, use_data_before_expert_parallel: bool = False,
                            mpu: Any = None, autoep_enabled: bool = True, tp_preset: str | None = None,
                            ep_preset: str | None = None, zero_offload_optimizer: bool = False,
                            zero_offload_param: bool = False) -> None:
    """Refuse what the folded layout does not support, before any group exists (``ValueError`` naming the key)."""
    if not autoep_enabled:
        return
    folded = spec.tp_size > 1
    if spec.etp_size != 1:
        raise ValueError(f"expert_parallel.expert_tensor_parallel_size={spec.etp_size} is reserved for expert-"
                         "internal tensor parallelism, which is not supported; use expert_tensor_parallel_size=1")
    if tp_preset is not None and ep_preset is not None and tp_preset != ep_preset:
        raise ValueError(f"tensor_parallel.preset_model ({tp_preset!r}) and expert_parallel.preset_model "
                         f"({ep_preset!r}) must match when both are set")
    if folded and sp_size > 1:
        raise ValueError(f"tensor_parallel.autotp_size={spec.tp_size} and sequence parallelism (size {sp_size}) are "
                         "mutually exclusive with AutoEP")
    mpu_tp = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    if mpu_tp not in (None, 1, spec.tp_size):
        raise ValueError(f"mpu tensor/model parallel world size ({mpu_tp}) conflicts with "
                         f"tensor_parallel.autotp_size={spec.tp_size}")
    mpu_pp = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipeline_parallel_world_size",
                       "get_pipe_parallel_world_size")
    if mpu_pp not in (None, spec.pp_size):
        raise ValueError(f"mpu pipeline parallel world size ({mpu_pp}) conflicts with pp_size={spec.pp_size}")
    if not folded:
        return  # plain AutoEP: DeepCompile, pipelines and ZeRO-3 are the engine's own checks
    _validate_folded_features(spec, zero_stage=zero_stage, deepcompile_enabled=deepcompile_enabled,
                              use_data_before_expert_parallel=use_data_before_expert_parallel,
                              offload=zero_offload_optimizer or zero_offload_param)


def _validate_folded_features(spec: ParallelFoldingSpec, *, zero_stage: int, deepcompile_enabled: bool,
                              use_data_before_expert_parallel: bool, offload: bool) -> None:
    if deepcompile_enabled:
        raise ValueError("DeepCompile with AutoEP+AutoTP folding is not supported: disable compile.deepcompile, or "
                         "use AutoEP without tensor_parallel.autotp_size")
    if spec.pp_size > 1:
        raise ValueError(f"AutoEP+AutoTP folding supports pp_size=1 only, got pp_size={spec.pp_size}")
    if spec.ep_size == 1:
        raise ValueError("AutoEP+AutoTP folding needs expert_parallel.autoep_size > 1: with one expert rank every TP "
                         "lane would compute (and count the gradient of) every routed token")
    if use_data_before_expert_parallel:
        raise ValueError("expert_parallel with use_data_before_expert_parallel_=True is not supported with "
                         "AutoEP+AutoTP folding; disable use_data_before_expert_parallel_")
    if zero_stage == 3:
        raise ValueError("AutoEP+AutoTP folding with ZeRO stage 3 is not built here (DeepSpeed keeps it for a "
                         "separate ZeRO-3 composition lane); use zero_optimization.stage 0, 1 or 2")
    if offload:
        raise ValueError("ZeRO optimizer/parameter offload is not supported with AutoEP+AutoTP folding; disable "
                         "zero_optimization.offload_optimizer / offload_param")


# ---- gradient families ------------------------------------------------------------------------------------------


def mark_autoep_folding_router_parameter(param: Any) -> None:
    """A router parameter computed identically on every TP peer (today's folded router): ``average``."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM)


def mark_autoep_folding_partial_router_parameter(param: Any) -> None:
    """A router whose token work stays split over the peers (each holds a partial gradient): ``sum`` in ``tp`` and
    ``sp`` modes. Not used by the current forward path."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM)


def mark_autoep_folding_sp_sharded_layernorm_parameter(param: Any) -> None:
    """A LayerNorm over a sequence-sharded activation: a partial (``sum``) in ``sp`` mode only, else ``average``."""
    setattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM)


def autoep_folding_param_family(param: Any, param_name: str | None = None) -> str | None:
    """The explicit family mark, else ``router_gate_replicated`` for a ``.router.`` name, else None."""
    family = getattr(param, AUTOEP_FOLDING_PARAM_FAMILY_ATTR, None)
    if family is None and param_name is not None and ".router." in param_name:
        family = AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM
    return family


def autoep_folding_gradient_reduction_strategy(folding_spec: Any, param: Any, *, param_name: str | None = None) -> str:
    """How the folded TP lanes reduce ``param``'s gradient: ``skip``, ``sum``, ``average`` or ``expert_tp_cancel``
    (see the module docstring). The engine and the ZeRO-1/2 optimizer both ask here."""
    if folding_spec is None or getattr(folding_spec, "tp_size", 1) <= 1:
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    if getattr(param, "model_parallel", False) or getattr(param, "tensor_model_parallel", False):
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    if hasattr(param, "allreduce") and not param.allreduce:
        return AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL
    family = autoep_folding_param_family(param, param_name)
    mode = getattr(folding_spec, "mp_mode", "tp")
    if family == AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM and mode in ("tp", "sp"):
        return AUTOEP_FOLDING_GRAD_REDUCE_SUM
    if family == AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM and mode == "sp":
        return AUTOEP_FOLDING_GRAD_REDUCE_SUM
    return AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE


def reduce_autoep_folding_gradient(folding_spec: Any, param: Any, grad: Any, *, tp_group: Any,
                                   param_name: str | None = None, comm: Any = None) -> str:
    """Apply ``param``'s strategy to ``grad`` in place over ``tp_group``; the strategy applied. Low-precision
    gradients are reduced in fp32 (the TP sum of bf16 lanes would round per addition). ``comm``: the module
    whose ``all_reduce`` / ``get_world_size`` run it (default ``torch.distributed``; the engine passes
    ``deepspeed.comm``)."""
    comm = dist if comm is None else comm
    strategy = autoep_folding_gradient_reduction_strategy(folding_spec, param, param_name=param_name)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_SKIP or grad is None or grad.is_sparse:
        return strategy
    data = grad.data
    tp_size = comm.get_world_size(group=tp_group)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL:
        if tp_size > 1:
            data.div_(tp_size)
        return strategy
    work = data if data.dtype == torch.float32 else data.float()
    comm.all_reduce(work, group=tp_group)
    if strategy == AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE:
        work.div_(tp_size)
    if work is not data:
        data.copy_(work)
    return strategy


def is_autoep_folding_gradient_corrected(param: Any) -> bool:
    """Whether ``param.grad`` already holds the folding correction (hooked parameters always do)."""
    return bool(getattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, False))


def clear_autoep_folding_gradient_corrected(param: Any) -> None:
    if hasattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR):
        setattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, False)


def apply_folding_correction_to_grad_buffer(folding_spec: Any, param: Any, grad: Any, *, tp_group: Any,
                                            param_name: str | None = None, use_correction_marker: bool = True,
                                            comm: Any = None) -> str:
    """:func:`reduce_autoep_folding_gradient` at most once per step when ``use_correction_marker`` (the mark is
    cleared by :func:`clear_autoep_folding_gradient_corrected` once the step consumed the gradient)."""
    if use_correction_marker and is_autoep_folding_gradient_corrected(param):
        return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    strategy = reduce_autoep_folding_gradient(folding_spec, param, grad, tp_group=tp_group, param_name=param_name,
                                              comm=comm)
    if use_correction_marker and strategy != AUTOEP_FOLDING_GRAD_REDUCE_SKIP:
        setattr(param, AUTOEP_FOLDING_GRAD_CORRECTED_ATTR, True)
    return strategy


def assert_group_matches_spec(existing_rank_lists: Any, spec: ParallelFoldingSpec, *,
                              group_kind: str = "ep_edp") -> None:
    """``RuntimeError`` when cached ``ep_size_<n>`` rank lists (a ``(ep, edp)`` pair or a dict with those keys) hold
    a group the folded layout does not have (groups created earlier for another layout)."""
    tables = expected_folding_group_tables(spec)
    if isinstance(existing_rank_lists, dict):
        observed = (existing_rank_lists.get("ep", ()), existing_rank_lists.get("edp", ()))
    else:
        observed = tuple(existing_rank_lists)
    for what, lists, expected in (("expert-parallel", observed[0], tables.ep_groups),
                                  ("expert-data-parallel", observed[1], tables.edp_groups)):
        allowed = {tuple(group) for group in expected}
        for group in _as_rank_tuples(lists):
            if group not in allowed:
                raise RuntimeError(f"cached {what} group {group} ({group_kind}) does not match folding spec "
                                   f"{spec}: expected one of {sorted(allowed)}")


def _as_rank_tuples(lists: Iterable[Iterable[int]]) -> list[tuple[int, ...]]:
    return [tuple(int(rank) for rank in group) for group in lists]

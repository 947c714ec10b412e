"""The engine's side of AutoEP folded onto AutoTP (``ds_moe.autoep.folded``): DeepSpeed's explicit gradient
correction entry point, the ``folding`` entry of each checkpoint file (:class:`AutoEPFoldingCheckpointShards`)
and its check against this run on load.

Gradients of a folded model are corrected as they arrive (backward hooks installed by ``apply_autoep_folded``,
which mark the parameters corrected), so :meth:`_reduce_autoep_folding_tp_replicated_gradients` only touches
gradients nothing corrected yet (parameters added after initialize, or a caller's own gradients).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed.checkpoint.constants import FOLDING_METADATA_KEY
from deepspeed.checkpoint.folding_metadata import make_folding_metadata, validate_folding_metadata
from deepspeed.runtime.checkpointing.layout import model_states_name
from deepspeed.utils import groups
from ds_moe.autoep.folding import apply_folding_correction_to_grad_buffer, autoep_folding_param_family


def folding_spec_of(module: torch.nn.Module) -> Any:
    """The ``ParallelFoldingSpec`` the module's AutoEP layers are folded with (None: not folded)."""
    for sub in module.modules():
        handles = getattr(sub, "folding_group_handles", None)
        if handles is not None:
            return handles.spec
    return None


def bind_folding(engine: Any) -> None:
    """Record the module's folding layout on the engine and on a ZeRO-1/2 optimizer (DeepSpeed's attributes
    ``_autoep_folding_spec``, ``autoep_folding_spec`` / ``autoep_folding_tp_group``)."""
    spec = folding_spec_of(engine.module)
    engine._autoep_folding_spec = spec
    optimizer = getattr(engine, "optimizer", None)
    if spec is not None and optimizer is not None and hasattr(type(optimizer), "autoep_folding_spec"):
        optimizer.autoep_folding_spec = spec
        optimizer.autoep_folding_tp_group = groups.get_tensor_model_parallel_group()


class AutoEPFoldingMethods:
    """Mixed into ``DeepSpeedEngine``."""

    _autoep_folding_spec: Any = None  # set by deepspeed.initialize when AutoEP is folded onto AutoTP

    def _reduce_autoep_folding_tp_replicated_gradients(self) -> None:
        """Correct every uncorrected ``param.grad`` over the tensor-parallel group by its folding family
        (``average`` for replicated parameters, ``/tp_size`` for routed experts; see ``ds_moe.autoep.folding``)."""
        spec = self._autoep_folding_spec
        if spec is None or getattr(spec, "tp_size", 1) <= 1 or not dist.is_initialized():
            return
        tp_group = groups.get_tensor_model_parallel_group()
        for name, param in self.module.named_parameters():
            if param.grad is not None:
                apply_folding_correction_to_grad_buffer(spec, param, param.grad, tp_group=tp_group, param_name=name,
                                                        comm=dist)

    @staticmethod
    def _validate_autoep_folding_checkpoint_metadata(state: Any, *, folding_spec: Any, family: str | None = None,
                                                     zero_partition_group: str | None = None,
                                                     zero_partition_count: int | None = None,
                                                     **expected: Any) -> dict[str, Any] | None:
        """Check a loaded file's folding metadata against the run: a folded checkpoint needs a folded run with
        the same sizes, and a folded run needs the metadata (``RuntimeError`` naming the difference)."""
        saved = isinstance(state, dict) and FOLDING_METADATA_KEY in state
        if folding_spec is None or getattr(folding_spec, "tp_size", 1) <= 1:
            folding = state[FOLDING_METADATA_KEY] if saved else {}
            if int(folding.get("tp_size", 1)) > 1:
                raise RuntimeError(f"this checkpoint was saved by AutoEP folded onto AutoTP (tp_size="
                                   f"{folding.get('tp_size')}, ep_size={folding.get('ep_size')}) and requires a "
                                   "folded runtime with the same sizes; this run is not folded")
            return None
        return validate_folding_metadata(state, tp_size=folding_spec.tp_size, ep_size=folding_spec.ep_size,
                                         etp_size=folding_spec.etp_size, family=family,
                                         zero_partition_group=zero_partition_group,
                                         zero_partition_count=zero_partition_count, **expected)


class AutoEPFoldingCheckpointShards:
    """Checkpoint extension of a folded engine: every file it saves records the folded layout it was written
    under (``deepspeed.checkpoint.folding_metadata``): the model states as ``dense`` (with each replicated
    parameter's family), the per-expert files as ``routed_expert`` (partitioned over the expert-data-parallel
    group), ZeRO's optimizer shards as ``zero_optimizer_state`` (each parameter's family and partition group).
    Loading checks the model states' entry against this run before anything is read into the model."""

    owns_optimizer_state = False
    owns_module_state = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.handles = next(m.folding_group_handles for m in engine.module.modules()
                            if getattr(m, "folding_group_handles", None) is not None)
        self.spec = self.handles.spec

    def _entry(self, family: str, group: str, group_ranks: tuple[int, ...], **extra: Any) -> dict[str, Any]:
        rank = dist.get_rank()
        return make_folding_metadata(tp_size=self.spec.tp_size, tp_rank=self.handles.tp_ranks.index(rank),
                                     ep_size=self.spec.ep_size, ep_rank=self.handles.ep_ranks.index(rank),
                                     zero_partition_group=group, zero_partition_rank=group_ranks.index(rank),
                                     zero_partition_count=len(group_ranks), family=family, **extra)

    def _families(self) -> dict[str, str]:
        return {name: autoep_folding_param_family(p, name) or "dense"
                for name, p in self.engine.module.named_parameters() if getattr(p, "allreduce", True)}

    def model_state_extras(self) -> dict[str, Any]:
        return {FOLDING_METADATA_KEY: self._entry("dense", "dense_dp", self.handles.dense_dp_ranks,
                                                  param_families=self._families())}

    def files_to_save(self, ctx: Any) -> dict[str, Any]:
        return {}

    def decorate_files(self, files: dict[str, Any]) -> None:
        """Add the ``folding`` entry to the per-expert files and ZeRO's optimizer shards this rank writes."""
        for name, obj in files.items():
            if not isinstance(obj, dict) or FOLDING_METADATA_KEY in obj:
                continue
            if name.startswith("layer_") and "_expert_" in name:
                obj[FOLDING_METADATA_KEY] = self._entry("routed_expert", "edp", self.handles.edp_ranks)
            elif name.endswith("_optim_states.pt"):
                per_param = {name: {"family": "routed_expert", "zero_partition_group": "edp"}
                             for name, p in self.engine.module.named_parameters() if not getattr(p, "allreduce", True)}
                per_param.update({name: {"family": family, "zero_partition_group": "dense_dp"}
                                  for name, family in self._families().items()})
                obj[FOLDING_METADATA_KEY] = self._entry("zero_optimizer_state", "per_family",
                                                        self.handles.dense_dp_ranks, param_families=per_param)

    def prepare_load(self, ctx: Any, load: Any) -> Any:
        state = load(model_states_name(ctx.parallel.mp_rank))
        AutoEPFoldingMethods._validate_autoep_folding_checkpoint_metadata(state, folding_spec=self.spec,
                                                                          family="dense",
                                                                          zero_partition_group="dense_dp")
        return lambda: None

    def load_files(self, ctx: Any, load: Any) -> None:
        self.prepare_load(ctx, load)()

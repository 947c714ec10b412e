"""The engine's side of AutoEP folded onto AutoTP (``ds_moe.autoep.folded``): DeepSpeed's explicit gradient
correction entry point and the check of a checkpoint's folding metadata against this run.

Gradients of a folded model are corrected as they arrive (backward hooks installed by ``apply_autoep_folded``,
which mark the parameters corrected), so :meth:`_reduce_autoep_folding_tp_replicated_gradients` only touches
gradients nothing corrected yet (parameters added after initialize, or a caller's own gradients).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed.checkpoint.constants import FOLDING_METADATA_KEY
from deepspeed.checkpoint.folding_metadata import validate_folding_metadata
from deepspeed.utils import groups
from ds_moe.autoep.folding import apply_folding_correction_to_grad_buffer


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

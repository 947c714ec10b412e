"""``pipeline`` section: settings of the pipeline-parallel engine."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from ds_config._base import DSConfigModel
from ds_config._types import Bool, NonNeg, PosInt


class PipelineConfig(DSConfigModel):
    """``pipeline``: defaults for ``PipelineModule`` / ``PipelineEngine``."""

    stages: PosInt | Literal["auto"] = "auto"
    """Number of pipeline stages; ``"auto"`` takes it from the model's ``PipelineModule``."""
    partition: str = "best"
    """Layer partitioning method: ``parameters``, ``uniform``, ``best`` or ``type:<regex>``."""
    seed_layers: Bool = False
    """Seed each layer's initialisation with its index."""
    activation_checkpoint_interval: NonNeg = 0
    """Checkpoint activations every N layers (0 disables)."""
    pipe_partitioned: Bool = True
    """Partition activations sent between stages across the tensor-parallel group."""
    grad_partitioned: Bool = True
    """Partition gradients sent between stages across the tensor-parallel group."""
    use_reentrant: Bool | None = None
    """``false``: activation checkpointing of the pipeline's layers uses DeepSpeed's non-reentrant checkpoint;
    ``true``/``null``: DeepSpeed's (reentrant) default."""

    @field_validator("partition")
    @classmethod
    def _method(cls, value: str) -> str:
        if value.lower() in ("parameters", "uniform", "best") or value.lower().startswith("type:"):
            return value
        raise ValueError("accepted: 'parameters', 'uniform', 'best' or 'type:<regex>'")

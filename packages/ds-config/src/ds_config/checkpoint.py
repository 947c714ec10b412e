"""``checkpoint`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ds_config._base import DSConfigModel
from ds_config._types import Bool


class ParallelWriteConfig(DSConfigModel):
    """``checkpoint.parallel_write``."""

    pipeline_stage: Bool = False
    """Write pipeline-parallel checkpoint files from every stage in parallel."""


class CheckpointConfig(DSConfigModel):
    """``checkpoint``: how training checkpoints are validated, written and loaded."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """Check that checkpoint tags agree across ranks: ``Ignore``, ``Warn`` or ``Fail`` (case-insensitive)."""
    load_universal: Bool = False
    """Load a Universal Checkpoint (allows changing the parallel layout)."""
    use_node_local_storage: Bool = False
    """Save per local rank, so checkpoints load without a shared file system."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalise(cls, value: object) -> object:
        return value.capitalize() if isinstance(value, str) else value

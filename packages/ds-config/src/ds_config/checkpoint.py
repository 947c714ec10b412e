"""``checkpoint`` section."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ds_config._base import DSConfigModel
from ds_config._types import Bool, PosInt


class ParallelWriteConfig(DSConfigModel):
    """``checkpoint.parallel_write``."""

    pipeline_stage: Bool = False
    """Write pipeline-parallel checkpoint files from every stage in parallel."""


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


class CheckpointWriterConfig(DSConfigModel):
    """``checkpoint.writer``: DeepSpeed's checkpoint writer engines (validated; not built here, see unbuilt)."""

    type: Literal["MOCK", "PYTHON", "FAST"] = "FAST"
    io_buffer_size: PosInt = 64 * 1024**2
    io_buffer_double: Bool = True
    show_statistics: Bool = False
    data_parallel: Literal["REPLICA", "SOCKET", "MACHINE"] | None = None
    decoupled: Bool = False
    io_multiplier: PosInt = 1

    @field_validator("type", "data_parallel", mode="before")
    @classmethod
    def _case_insensitive(cls, value: Any) -> Any:
        return _upper(value)


class CheckpointConfig(DSConfigModel):
    """``checkpoint``: how training checkpoints are validated, written and loaded."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """Check that checkpoint tags agree across ranks: ``Ignore``, ``Warn`` or ``Fail`` (case-insensitive)."""
    load_universal: Bool = False
    """Load a Universal Checkpoint (allows changing the parallel layout)."""
    use_node_local_storage: Bool = False
    """Save per local rank, so checkpoints load without a shared file system."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: Bool = True
    writer: CheckpointWriterConfig | None = None

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _capitalise(cls, value: object) -> object:
        return value.capitalize() if isinstance(value, str) else value

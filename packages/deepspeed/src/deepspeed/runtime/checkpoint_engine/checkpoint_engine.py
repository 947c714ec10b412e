"""``deepspeed.runtime.checkpoint_engine.checkpoint_engine``: the interface a checkpoint writer implements.

A save is ``create(info)``, any number of ``save(state, path)``, then ``commit(info)``; an engine whose writes
finish later (``is_decoupled()``) makes them durable by ``commit``. ``load(path)`` reads one file back.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class CheckpointCommitInfo:
    """Which checkpoint a ``create``/``commit`` pair is about: its tag, folder and the saving step."""

    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(ABC):
    """Base of checkpoint writers; ``config_params`` is the engine's checkpoint config (may be None)."""

    def __init__(self, config_params: Any = None) -> None:
        self.name: str | None = None
        self.config_params = config_params
        self.commit_info: CheckpointCommitInfo | None = None

    def create(self, info: CheckpointCommitInfo) -> None:  # noqa: B027 - optional hook, as DeepSpeed's
        """A checkpoint starts (nothing to prepare for a synchronous writer)."""

    @abstractmethod
    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` to ``path``."""

    def makedirs(self, path: str | os.PathLike, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    @abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any:
        """Read one file written by ``save``."""

    @abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of the checkpoint ``info`` names is written; True once durable."""

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether this data-parallel rank writes the replicated files (rank 0)."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        """True when ``save`` returns before the bytes are written (``commit`` waits)."""
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:
        self.commit_info = info

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return self.commit_info

    def cleanup(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, buffers); nothing for a synchronous writer."""

    def preserves_storage_sharing(self) -> bool:
        """True when tensors sharing a storage stay shared in the file (``torch.save`` keeps them)."""
        return True

"""``deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine``: ``TorchCheckpointEngine``, synchronous
``torch.save``/``torch.load``, writing each file atomically (temporary name, fsync, rename) as the engine's own
checkpoints do (``runtime.checkpointing``)."""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.runtime.checkpointing.serialize import load_file, save_file


class TorchCheckpointEngine(CheckpointEngine):
    """Synchronous torch serialization; a file is complete once ``save`` returns."""

    def __init__(self, config_params: Any = None) -> None:
        super().__init__(config_params)
        self.name = "TorchCheckpointEngine"

    def save(self, state_dict: Any, path: str) -> None:
        save_file(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read ``path`` (``weights_only`` where the content allows, see ``runtime.checkpointing``)."""
        return load_file(path, map_location="cpu" if map_location is None else map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Nothing pending: every ``save`` already wrote its file."""
        return True

"""``deepspeed.runtime.checkpoint_engine``: DeepSpeed's pluggable checkpoint writer interface and its torch engine."""

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine"]

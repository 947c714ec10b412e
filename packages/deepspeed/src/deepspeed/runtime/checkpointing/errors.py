"""The errors the checkpointing layer raises; all derive from :class:`CheckpointError` (a ``RuntimeError``).

Bad arguments (``save_dir=None``) are plain ``ValueError``s, raised on every rank of a collective call.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointSyncError(CheckpointError):
    """Ranks disagreed about a collective checkpoint call: some never arrived, or called something else."""


class CheckpointTagError(CheckpointError, ValueError, AssertionError):
    """A bad tag, or tags that differ across ranks under ``checkpoint.tag_validation: Fail``.

    Also an ``AssertionError``: DeepSpeed's ``tag_validation: Fail`` is an ``assert``, so code catching
    ``AssertionError`` around ``save_checkpoint`` keeps working.
    """


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file exists but cannot be read (truncated, corrupt, or not a torch file), or its content is
    not what the loader needs (a missing key, a tensor of the wrong shape).

    ``checkpoint_path``: the file; ``reason``: the cause without the path ("truncated (...)", "not a checkpoint
    file (unpickling failed: ...)"). Both may be None for errors built from a message alone.
    """

    def __init__(self, message: str, path: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint_path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        # multiprocessing re-raises a worker's error in the parent by unpickling it: rebuild through this
        # __init__ (an unpicklable exception kills the pool's result thread and the parent waits forever)
        return type(self), (str(self), self.checkpoint_path, self.reason), dict(self.__dict__)


class CheckpointRankError(CheckpointError):
    """A collective checkpoint call failed on some ranks; raised on every rank with the same message.

    ``op`` ("load_checkpoint", "save_checkpoint"), ``phase`` ("reading", "writing", ...), ``rank`` (this
    process's global rank), ``failures``: ``{global rank: RankFailure(file, cause)}`` of every failing rank.
    The message format is documented in ``deepspeed.runtime.checkpointing._agreement``.
    """

    def __init__(self, message: str, op: str, phase: str, rank: int, failures: dict) -> None:
        super().__init__(message)
        self.op, self.phase, self.rank, self.failures = op, phase, rank, failures

    def __reduce__(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        # multiprocessing re-raises a worker's error in the parent by unpickling it: rebuild through this
        # __init__ (an unpicklable exception kills the pool's result thread and the parent waits forever)
        return type(self), (str(self), self.op, self.phase, self.rank, self.failures), dict(self.__dict__)


class CheckpointRankValueError(CheckpointRankError, ValueError):
    """:class:`CheckpointRankError` raised on a rank whose own failure was a ``ValueError`` (bad content, e.g. a
    checkpoint of another layout), so callers catching ``ValueError`` as with DeepSpeed still do."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds Python objects that ``torch.load(weights_only=True)`` refuses to build."""

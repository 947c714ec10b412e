"""The errors the checkpointing layer raises; all derive from :class:`CheckpointError` (a ``RuntimeError``).

Bad arguments (``save_dir=None``) are plain ``ValueError``s, raised on every rank of a collective call.
"""

from __future__ import annotations


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
    """A checkpoint file exists but cannot be read (truncated, corrupt, or not a torch file)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds Python objects that ``torch.load(weights_only=True)`` refuses to build."""

"""``checkpoint.tag_validation``: do all ranks use the same tag? (Ignore / Warn / Fail)

A rank-specific tag (``f"step{n}_rank{rank}"``) scatters one checkpoint over several directories and breaks
resuming with a different world size; DeepSpeed warns by default.
"""

from __future__ import annotations

from deepspeed.runtime.checkpointing.errors import CheckpointTagError
from deepspeed.utils.logging import logger


def describe_tags(tags: dict[int, str]) -> str:
    """``'a' on ranks [0, 2]; 'b' on ranks [1]``."""
    by_tag: dict[str, list[int]] = {}
    for rank, tag in sorted(tags.items()):
        by_tag.setdefault(tag, []).append(rank)
    return "; ".join(f"{tag!r} on ranks {ranks}" for tag, ranks in by_tag.items())


def validate_tags(tags: dict[int, str], mode: str, rank: int) -> bool:
    """Apply ``mode`` to the tags every rank passed (by global rank); True when they agree.

    ``Fail`` raises :class:`CheckpointTagError` on every rank (so nobody writes), ``Warn`` logs a warning,
    ``Ignore`` does nothing.
    """
    if mode not in ("Ignore", "Warn", "Fail"):
        raise ValueError(f"checkpoint.tag_validation={mode!r}; accepted: 'Ignore', 'Warn', 'Fail'")
    consistent = len(set(tags.values())) <= 1
    if consistent or mode == "Ignore":
        return consistent
    message = (
        f"[rank={rank}] The checkpoint tag name {tags.get(rank)!r} is not consistent across all ranks "
        f"({describe_tags(tags)}). Including rank unique information in checkpoint tag could cause issues when "
        "restoring with different world sizes."
    )
    if mode == "Fail":
        raise CheckpointTagError(message + " (checkpoint.tag_validation is 'Fail')")
    logger.warning(message)
    return consistent

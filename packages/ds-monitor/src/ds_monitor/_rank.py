"""Which process writes: only global rank 0 talks to the monitoring backends."""

from __future__ import annotations

import os
import sys

__all__ = ["resolve_rank"]


def resolve_rank(rank: int | None = None) -> int:
    """The global rank of this process.

    ``rank`` when given; else ``torch.distributed.get_rank()`` when torch.distributed is already imported and
    initialised (torch is never imported here: the monitors must not need it); else the ``RANK`` environment
    variable set by the launchers; else 0 (a single process).
    """
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r}: expected a non-negative int (the global rank) or None")
        return rank
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    env = os.environ.get("RANK", "").strip()
    if not env:
        return 0
    if not env.isdigit():
        raise ValueError(f"environment variable RANK={env!r}: expected a non-negative integer (this process's "
                         "global rank); fix it or pass rank= explicitly")
    return int(env)

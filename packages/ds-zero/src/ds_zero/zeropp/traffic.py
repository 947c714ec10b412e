"""Bytes each rank sends through the ZeRO-3 collectives, by kind, counted where the collectives are issued.

Kinds: ``param_gather`` (parameter all-gathers), ``param_gather_secondary`` (hpZ: from the secondary
partition), ``grad_reduce`` (the gradient reduce-scatter or qgZ all-to-all reduce) and ``grad_replica``
(MiCS's all-reduce across shard-group replicas). The count is what this rank puts on the wire:
``(world - 1) * chunk`` for an all-gather of a ``chunk``-byte partition, the rows sent to the other ranks for a
reduce-scatter or an all-to-all, ``2 (world - 1) / world`` times the buffer for an all-reduce (a ring's
traffic). ZeRO++'s claims (qwZ, qgZ: about 4x less traffic) are checked against these counts.
"""

from __future__ import annotations

from collections import Counter

_SENT: Counter[str] = Counter()


def record(kind: str, nbytes: int) -> None:
    """Count ``nbytes`` sent by this rank under ``kind``."""
    _SENT[kind] += int(nbytes)


def sent_bytes() -> dict[str, int]:
    """Bytes sent by this rank since the last :func:`reset`, by kind."""
    return dict(_SENT)


def reset() -> None:
    _SENT.clear()

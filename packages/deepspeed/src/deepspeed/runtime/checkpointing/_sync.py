"""Meeting points for collective checkpoint calls, held in the process group's key-value store.

Why the store and not a barrier: a checkpoint call that only some ranks make (``save_checkpoint`` under
``if rank == 0``) must fail fast, naming the ranks that never came, instead of hanging. Each rank posts a key
``ds_ckpt/<group>/<round>/<phase>/<rank>`` and polls until every rank's key exists or the timeout passes;
then it knows exactly who is missing. Unlike ``dist.monitored_barrier`` this works with every backend (NCCL
included, with no extra gloo group), every rank (not only rank 0) learns who is missing, a timed-out wait
leaves no half-matched send/recv pairs or collective sequence numbers behind to corrupt the next collective,
and the same keys carry each rank's tag (tag validation) and write status for free.

Rounds are numbered per process group in each process, so the n-th checkpoint call of every rank meets the
n-th of the others. A round whose first meeting times out is rolled back, so a rank-0-only call leaves the
numbering intact for the next correct call. Each rank deletes its previous round's keys once everybody has
arrived at the next round (by then all ranks are done reading them).

When a rank is missing, or the store itself fails (it is served by rank 0's process: rank 0 died), the error
says what this host sees of the other ranks (:func:`deepspeed.runtime.peer_failure.peer_states`): a rank
killed or stopped mid-save is named as such, and the "call it on every rank" hint is kept for ranks that are
alive but never came.
"""

from __future__ import annotations

import hashlib
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from deepspeed.runtime.checkpointing._state import SyncOptions
from deepspeed.runtime.checkpointing.errors import CheckpointError, CheckpointSyncError
from deepspeed.runtime.peer_failure import peer_states

_PREFIX = "ds_ckpt"
_QUICK_POLL_S = 0.001  # seconds between checks of the store while waiting under _QUICK_PHASE_S (16 ranks; more
_QUICK_PHASE_S = 0.5  # ranks poll proportionally slower), then a growing interval up to _SLOW_POLL_S
_SLOW_POLL_S = 0.05
# per process group: (next round number, the keys this process posted in the last completed round)
_rounds: weakref.WeakKeyDictionary[Any, tuple[int, list[str]]] = weakref.WeakKeyDictionary()


def resolve_timeout_s(sync: SyncOptions) -> float:
    """``SyncOptions.timeout_s``, else ``DS_CHECKPOINT_TIMEOUT`` (seconds), else the process-group timeout."""
    if sync.timeout_s is not None:
        value, source = sync.timeout_s, "SyncOptions.timeout_s"
    elif os.environ.get("DS_CHECKPOINT_TIMEOUT"):
        raw = os.environ["DS_CHECKPOINT_TIMEOUT"]
        try:
            value, source = float(raw), "DS_CHECKPOINT_TIMEOUT"
        except ValueError:
            raise ValueError(f"DS_CHECKPOINT_TIMEOUT={raw!r} must be a number of seconds") from None
    else:
        from deepspeed.comm.comm import default_pg_timeout

        value, source = default_pg_timeout.total_seconds(), "deepspeed.comm.default_pg_timeout"
    if not value > 0:
        raise ValueError(f"{source}={value!r}: the checkpoint sync timeout must be a positive number of seconds")
    return float(value)


def _default_store() -> Any:
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()  # no public accessor exists; see SyncOptions.store
    except Exception as exc:
        raise CheckpointError(
            "checkpoint sync: cannot reach the default process group's store; pass SyncOptions(store=...)"
        ) from exc


class Meeting:
    """The meeting points of one collective checkpoint call (``op``: "save_checkpoint", ...)."""

    def __init__(self, op: str, sync: SyncOptions) -> None:
        self.op = op
        self.timeout_s = resolve_timeout_s(sync)
        self._group = sync.group if sync.group is not None else dist.group.WORLD
        self.ranks: list[int] = sorted(dist.get_process_group_ranks(self._group))
        self.rank = dist.get_rank()
        self._store = sync.store if sync.store is not None else _default_store()
        group_id = hashlib.sha1(",".join(map(str, self.ranks)).encode()).hexdigest()[:12]
        self._round, self._stale = _rounds.get(self._group, (0, []))
        _rounds[self._group] = (self._round + 1, self._stale)
        self._base = f"{_PREFIX}/{group_id}/{self._round}"
        self._posted: list[str] = []
        self._arrived = False

    def _key(self, phase: str, rank: int) -> str:
        return f"{self._base}/{phase}/{rank}"

    def exchange(self, phase: str, value: str, waiting_for: str) -> dict[int, str]:
        """Post ``value``, wait for every rank's, return them by global rank.

        ``waiting_for`` completes the timeout message: "ranks [1] did not <waiting_for> within 30 s".
        """
        mine = self._key(phase, self.rank)
        keys = [self._key(phase, rank) for rank in self.ranks]
        try:
            self._store.set(mine, value)
            self._posted.append(mine)
            missing = self._wait(keys)
            if missing:
                self._fail(missing, waiting_for)
            if not self._arrived:
                self._arrived = True
                self._forget_stale()
            _rounds[self._group] = (self._round + 1, self._posted)
            return dict(zip(self.ranks, self._values(keys), strict=True))
        except CheckpointSyncError:
            raise
        except Exception as exc:  # the store's transport: DistNetworkError, a reset connection, a timeout
            others = [rank for rank in self.ranks if rank != self.rank]
            peers = "; ".join(line for line, _ in peer_states(others))
            raise CheckpointSyncError(
                f"{self.op} on rank {self.rank}: the process group's store (served by rank 0's process) failed "
                f"while waiting for every rank to {waiting_for}: {type(exc).__name__}: {' '.join(str(exc).split())}"
                f". Peers: {peers}") from exc

    def _wait(self, keys: Sequence[str]) -> list[int]:
        start = time.monotonic()
        deadline = start + self.timeout_s
        # Ranks usually arrive within a few ms to a few hundred ms of each other (one writes more bytes): poll
        # finely then, so nobody oversleeps the last arrival; then back off, gentle on the store when a rank is slow
        quick = _QUICK_POLL_S * max(1.0, len(self.ranks) / 16)
        while not self._store.check(list(keys)):
            now = time.monotonic()
            if now >= deadline:
                return [rank for rank, key in zip(self.ranks, keys, strict=True) if not self._store.check([key])]
            waited = now - start
            time.sleep(quick if waited < _QUICK_PHASE_S else min(waited / 8, _SLOW_POLL_S))
        return []

    def _values(self, keys: list[str]) -> list[str]:
        getter = getattr(self._store, "multi_get", None)
        raw = getter(keys) if getter is not None else [self._store.get(key) for key in keys]
        return [item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in raw]

    def _fail(self, missing: list[int], waiting_for: str) -> None:
        arrived = [rank for rank in self.ranks if rank not in missing]
        if not self._arrived:
            # roll the round back so a later, correct call of every rank still meets at the same round
            for key in self._posted:
                self._store.delete_key(key)
            _rounds[self._group] = (self._round, self._stale)
        states = peer_states(missing)
        hint = (f"{self.op} is collective: every rank of the group must call it, not only rank 0"
                if not all(down for _, down in states) else
                f"A rank that died, stopped or raised cannot reach {self.op}'s meeting")
        raise CheckpointSyncError(
            f"{self.op} on rank {self.rank}: ranks {missing} did not {waiting_for} within {self.timeout_s:g} s "
            f"(ranks {arrived} did): {'; '.join(line for line, _ in states)}. {hint}"
        )

    def _forget_stale(self) -> None:
        for key in self._stale:
            self._store.delete_key(key)


def open_meeting(op: str, sync: SyncOptions) -> Meeting | None:
    """A :class:`Meeting` for ``op``, or None when there is nobody to meet (no process group, or one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = sync.group if sync.group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return None
    return Meeting(op, sync)


# Tags never contain NUL (``validate_tag``), so an arrival whose tag starts with it carries instead the error
# of a rank whose own arguments were bad: the others learn it at once rather than waiting out the timeout.
_BAD_ARGUMENTS = "\0"


def arrive(meeting: Meeting, op: str, tag: str | None, problem: Exception | None) -> dict[int, str]:
    """The first meeting of a collective call: post ``"<op>|<tag>"`` (or this rank's argument error), wait
    for every rank, then raise on every rank if any rank's arguments were bad; returns the tags by rank.

    A rank with bad arguments re-raises its own error; the others raise ``ValueError`` naming it, so no rank
    is left waiting for one that will never come.
    """
    value = f"{op}|{tag}" if problem is None else f"{op}|{_BAD_ARGUMENTS}{problem}"
    arrivals = meeting.exchange("arrive", value, f"call {op} (tag {tag!r})")
    if problem is not None:
        raise problem
    return check_same_call(op, arrivals, meeting.rank)


def check_same_call(op: str, arrivals: dict[int, str], rank: int) -> dict[int, str]:
    """Split ``"<op>|<tag>"`` arrivals; raise if some rank made a different checkpoint call or was called with
    bad arguments. Returns tags."""
    calls: dict[str, list[int]] = {}
    tags: dict[int, str] = {}
    for peer, value in arrivals.items():
        peer_op, _, tag = value.partition("|")
        calls.setdefault(peer_op, []).append(peer)
        tags[peer] = tag
    if len(calls) > 1:
        detail = "; ".join(f"{name} on ranks {peers}" for name, peers in sorted(calls.items()))
        raise CheckpointSyncError(f"{op} on rank {rank}: ranks made different checkpoint calls at once: {detail}")
    bad = {peer: tag[len(_BAD_ARGUMENTS):] for peer, tag in tags.items() if tag.startswith(_BAD_ARGUMENTS)}
    if bad:
        detail = "; ".join(f"rank {peer}: {message}" for peer, message in sorted(bad.items()))
        raise ValueError(f"{op} on rank {rank}: ranks {sorted(bad)} were called with invalid arguments ({detail}); "
                         f"{op} is collective, so every rank stops")
    return tags

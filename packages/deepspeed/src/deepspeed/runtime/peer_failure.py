"""Name the rank and the cause when a collective fails because a peer rank died, stalled or dropped out.

Why: gloo reports a dead peer as "Connection closed by peer [127.0.0.1]:40123" and a stalled one as "Timed out
waiting 6000ms for recv operation", naming neither the peer's rank nor what happened to it. The engine runs its
forward, backward and step inside :func:`named_peer_failures`, which turns such a transport error into a
:class:`PeerFailureError` naming this rank, the phase, the global step, and for each peer what this host can see
of it: every engine posts ``<host> <pid>`` to the process group's store at start (:func:`announce`), so a
survivor on the same host reads the peer's process state (gone, stopped by SIGSTOP, a zombie) from ``/proc``,
and a rank whose own forward, backward or step raised (a full disk in an NVMe swap, ...) leaves that error in the
store too, so the ranks it strands name its cause, not only its absence.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

_KEY = "ds_peer/{}"
_ERROR_KEY = "ds_peer_error/{}"
_TRANSPORT_MARKS = ("/gloo/", "Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                    "pair closure", "NCCL error", "ProcessGroupNCCL", "Broken pipe")
_STATES = {"T": "is stopped (SIGSTOP/SIGTSTP): a stalled rank, the others time out waiting for it",
           "t": "is stopped by a debugger (tracing stop)", "Z": "has died (not yet reaped by its parent)",
           "X": "has exited"}


class PeerFailureError(RuntimeError):
    """A collective failed because another rank died, stalled past the process-group timeout, or disconnected."""


def _store():
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()  # no public accessor exists
    except Exception:  # no default group, or one built without a store
        return None


def announce() -> None:
    """Post this process's host and pid for the other ranks (not a collective; a no-op without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_KEY.format(dist.get_rank()), f"{socket.gethostname()} {os.getpid()}")


def _post_error(step: int, phase: str, exc: BaseException) -> None:
    """Leave this rank's own failure in the store, so that the peers it strands can say what happened."""
    store = _store() if dist.is_available() and dist.is_initialized() else None
    if store is not None:
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
        with contextlib.suppress(Exception):
            store.set(_ERROR_KEY.format(dist.get_rank()), f"{phase} at global_steps={step}: {text}")


def is_transport_error(exc: BaseException) -> bool:
    """Did ``exc`` come from the collective transport (a peer's death, a timeout) rather than from the model?"""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in _TRANSPORT_MARKS)


def _settled_state(pid: int, wait_s: float = 1.0) -> str:
    """The peer's state once a dying process has had ``wait_s`` to finish dying: its connections close while it
    exits, so the survivor can look a few milliseconds before the process leaves the running state."""
    deadline = time.monotonic() + wait_s
    state = _process_state(pid)
    while state.startswith("is alive") and time.monotonic() < deadline:
        time.sleep(0.02)
        state = _process_state(pid)
    return state


def _process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "is gone (killed or exited)"
    except (OSError, IndexError):
        return "is in an unknown state (/proc unreadable)"
    return _STATES.get(state, f"is alive (state {state})")


def _peer_state(store, rank: int, me: str) -> tuple[str, bool]:
    """What this host sees of ``rank``, and whether it is known to be down (gone, stopped, or raised)."""
    key = _KEY.format(rank)
    try:
        if not store.check([key]):
            return f"rank {rank}: never announced itself", False
        host, pid = store.get(key).decode().split()
    except Exception:
        return f"rank {rank}: unknown (the group's store, served by rank 0's process, is unreachable)", rank == 0
    raised = ""
    with contextlib.suppress(Exception):
        if store.check([_ERROR_KEY.format(rank)]):
            raised = f", and it raised in {store.get(_ERROR_KEY.format(rank)).decode()}"
    if host != me:
        return f"rank {rank} (pid {pid} on {host}): on another host, state not visible from here{raised}", bool(raised)
    state = _settled_state(int(pid))
    return f"rank {rank} (pid {pid}) {state}{raised}", bool(raised) or not state.startswith("is alive")


def peer_states(ranks: list[int]) -> list[tuple[str, bool]]:
    """For each of ``ranks``: a line saying what this host can see of it, and whether it is known to be down
    (its process gone or stopped, or it raised); a rank still running and silent is not down."""
    if not (dist.is_available() and dist.is_initialized()):
        return [(f"rank {r}: unknown (no process group)", False) for r in ranks]
    store, me = _store(), socket.gethostname()
    if store is None:
        return [(f"rank {r}: unknown (the process group has no store)", False) for r in ranks]
    return [_peer_state(store, r, me) for r in ranks]


def peer_report() -> str:
    """One line per other rank of the world: what this host can see of it."""
    if not (dist.is_available() and dist.is_initialized()):
        return "no process group"
    if _store() is None:
        return "peer states unknown (the process group has no store)"
    rank = dist.get_rank()
    return "; ".join(line for line, _ in peer_states([r for r in range(dist.get_world_size()) if r != rank]))


@contextlib.contextmanager
def named_peer_failures(step: int, phase: str) -> Iterator[None]:
    """Re-raise a transport error from the block as :class:`PeerFailureError` naming rank, step and peers."""
    try:
        yield
    except PeerFailureError:
        raise
    except Exception as exc:
        if not is_transport_error(exc) or not dist.is_initialized():
            _post_error(step, phase, exc)
            raise
        raise PeerFailureError(
            f"rank {dist.get_rank()}, {phase} at global_steps={step}: a collective with the other ranks failed; a "
            f"peer died, stalled past the process-group timeout ({_group_timeout()}: DEEPSPEED_TIMEOUT minutes or "
            f"init_distributed(timeout=...)) or lost its connection. Peers: {peer_report()}. "
            f"Transport error: {exc}") from exc


def _group_timeout() -> str:
    """The default group's timeout in seconds, as its backend holds it ("unknown" where torch hides it)."""
    for device in ("cpu", "cuda"):
        try:
            timeout = dist.group.WORLD._get_backend(torch.device(device)).options._timeout
            return f"{timeout.total_seconds():g} s"
        except Exception:
            continue
    return "unknown"

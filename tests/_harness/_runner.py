"""``run_distributed``: run one test body on N ranks of pooled worker processes and judge the outcome."""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from _harness import _pickling
from _harness._pool import Worker, get_pool, kill_with_stacks

DEFAULT_TIMEOUT_S = 60.0
FAILURE_GRACE_S = 1.0  # after one rank fails, how long the others get to finish or fail on their own
_LOCK = threading.Lock()
_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))


class DistributedTestFailure(AssertionError):
    """A rank raised, died or hung. ``ranks`` maps each rank to its :class:`RankOutcome`."""

    def __init__(self, message: str, ranks: dict[int, RankOutcome]) -> None:
        super().__init__(message)
        self.ranks = ranks


class DistributedTimeout(DistributedTestFailure):
    """The test ran past its timeout; the ranks still running were killed."""


@dataclass
class RankOutcome:
    """What happened to one rank. ``status``: ok, raised, exited, hung (timeout) or killed (a peer failed)."""

    rank: int
    pid: int
    status: str = "running"
    detail: str = ""  # traceback, stack dump or exit description
    data: bytes = b""
    output: str = ""
    at: float = 0.0  # seconds after the start of the test


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    init_process_group: bool = True,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the ranks' return values (index = rank).

    ``timeout`` (seconds, scaled by ``DS_TEST_TIMEOUT_SCALE``) bounds the test from the moment the ranks
    get it. With ``init_process_group=False`` the ranks only get the launcher environment (``MASTER_PORT``
    set to a free port) and the body initialises the group itself. Raises :class:`DistributedTestFailure`.
    """
    __tracebackhide__ = True
    _check(world_size, timeout, kwargs, backend)
    try:
        payload = _pickling.dumps((fn, tuple(args), dict(kwargs or {})))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"run_distributed: cannot send {fn!r} and its arguments to the ranks: {exc}") from exc
    limit = float(timeout) * _timeout_scale()
    with _LOCK:
        pool = get_pool()
        workers = pool.acquire(world_size)
        try:
            outcomes = _execute(workers, payload, limit, init_process_group, backend)
        except BaseException:  # interrupted (Ctrl-C, pytest-timeout): no worker survives this test
            for w in workers:
                w.kill()
            raise
        _emit_output(outcomes)
        if all(o.status == "ok" for o in outcomes):
            pool.release(workers)
            return [_result(o) for o in outcomes]
        # Ranks that returned are probably clean, but never reuse a process from a failed test.
        for w in workers:
            w.kill()
    cls = DistributedTimeout if any(o.status == "hung" for o in outcomes) else DistributedTestFailure
    raise cls(_describe(fn, world_size, limit, outcomes), {o.rank: o for o in outcomes})


def _timeout_scale() -> float:
    raw = os.environ.get("DS_TEST_TIMEOUT_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = -1.0
    if not scale > 0:
        raise ValueError(f"DS_TEST_TIMEOUT_SCALE={raw!r} must be a positive number (a factor on every timeout)")
    return scale


def _result(o: RankOutcome) -> Any:
    # A script's __main__ runs as __mp_main__ in the workers; let its classes come back by that name.
    if "__main__" in sys.modules:
        sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
    try:
        return pickle.loads(o.data)
    except Exception as exc:
        raise TypeError(f"run_distributed: the return value of rank {o.rank} cannot be unpickled here: {exc}") from exc


def _check(world_size: Any, timeout: Any, kwargs: Any, backend: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size={world_size!r} must be an int >= 1")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"run_distributed: timeout={timeout!r} must be a positive number of seconds")
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"run_distributed: backend={backend!r} must be a torch.distributed backend name")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"run_distributed: kwargs={kwargs!r} must be a dict or None")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _execute(workers: list[Worker], payload: bytes, limit: float, init: bool, backend: str) -> list[RankOutcome]:
    start = time.monotonic()
    outcomes = [RankOutcome(rank, w.pid) for rank, w in enumerate(workers)]
    task = {
        "kind": "run", "world_size": len(workers), "payload": payload, "timeout": limit, "init": init,
        "backend": backend, "port": None if init else _free_port(), "env": dict(os.environ),
        "cwd": os.getcwd(), "sys_path": list(sys.path),
    }
    for rank, w in enumerate(workers):
        try:
            w.send({**task, "rank": rank})
        except OSError:
            pass  # it died; the wait loop reports its exit code
    _wait(workers, outcomes, start, limit)
    return outcomes


def _wait(workers: list[Worker], outcomes: list[RankOutcome], start: float, limit: float) -> None:
    """Collect results until every rank is done, the timeout passes, or the grace after a failure ends."""
    index = {w.conn: r for r, w in enumerate(workers)} | {w.proc.sentinel: r for r, w in enumerate(workers)}
    failed_at: float | None = None
    while (pending := [r for r, o in enumerate(outcomes) if o.status == "running"]):
        now = time.monotonic()
        end = start + limit if failed_at is None else min(start + limit, failed_at + FAILURE_GRACE_S)
        if now >= end:
            break
        watch = [w.conn for r, w in enumerate(workers) if r in pending]
        watch += [w.proc.sentinel for r, w in enumerate(workers) if r in pending]
        for obj in multiprocessing.connection.wait(watch, timeout=end - now):
            rank = index[obj]
            if outcomes[rank].status == "running":
                _update(rank, workers, outcomes[rank], start)
                if outcomes[rank].status not in ("running", "ok") and failed_at is None:
                    failed_at = time.monotonic()
    late = "hung" if failed_at is None else "killed"
    for rank in pending:
        outcomes[rank].status = late
    stacks = kill_with_stacks([workers[r] for r in pending]) if pending else {}
    for rank in pending:
        outcomes[rank].detail = _trim_stack(stacks.get(workers[rank], ""))
        outcomes[rank].at = time.monotonic() - start
    for w, o in zip(workers, outcomes, strict=True):
        o.output = w.output()


def _trim_stack(dump: str) -> str:
    """A faulthandler dump without the harness: its watchdog thread and the frames below the test body."""
    blocks = []
    for block in dump.strip().split("\n\n"):
        if "in _watch_parent" in block:
            continue
        lines = []
        for line in block.splitlines():
            if line.strip().startswith(f'File "{_HARNESS_DIR}{os.sep}'):
                break  # most recent call first: everything from here down is the worker loop
            lines.append(line)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _update(rank: int, workers: list[Worker], outcome: RankOutcome, start: float) -> None:
    w = workers[rank]
    message = None
    if w.conn.poll():
        try:
            message = w.recv()
        except (EOFError, OSError):
            message = None
    outcome.at = time.monotonic() - start
    if message is None:
        if w.proc.is_alive():
            w.proc.join(1.0)  # the pipe closed; the exit status follows
        outcome.status, outcome.detail = "exited", _exit_text(w)
    elif message[0] == "port":
        for other in workers[1:]:
            try:
                other.send(("port", message[1]))  # type: ignore[arg-type]
            except OSError:
                pass
    elif message[0] == "ok":
        outcome.status, outcome.data = "ok", message[1]
    else:
        outcome.status, outcome.detail = "raised", message[1]


def _exit_text(w: Worker) -> str:
    code = w.proc.exitcode
    if code is None:
        return "closed its pipe without exiting"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"killed by {name} (exit code {code})"
    else:
        text = f"exited with code {code} without reporting a result"
    crash = w.stack_since(0).strip()
    return f"{text}\n{crash}" if crash else text


def _describe(fn: Any, world_size: int, limit: float, outcomes: list[RankOutcome]) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    bad = [o for o in outcomes if o.status in ("raised", "exited")]
    if bad:
        # A dead rank closes its sockets, so its peers may raise (gloo "connection closed") before the parent
        # even sees the death: deaths are the likelier cause and come first.
        first: RankOutcome | None = min(bad, key=lambda o: (o.status != "exited", o.at))
        head = f"rank {first.rank} {'raised' if first.status == 'raised' else first.detail.splitlines()[0]}"
    else:
        first = None
        hung = ", ".join(str(o.rank) for o in outcomes if o.status == "hung")
        head = f"timed out after {limit:g} s; ranks {hung} still running (killed)"
    lines = [f"distributed test {name} (world_size={world_size}) failed: {head}"]
    order = sorted(outcomes, key=lambda o: (o is not first, o.status == "ok", o.status in ("hung", "killed"), o.at))
    for o in order:
        lines.append(f"\n---- rank {o.rank} (pid {o.pid}): {_status_line(o, limit)} ----")
        if o.status != "ok" and o.detail:
            lines.append(o.detail.rstrip())
    return "\n".join(lines)


def _status_line(o: RankOutcome, limit: float) -> str:
    return {
        "ok": f"finished after {o.at:.2f} s",
        "raised": f"raised after {o.at:.2f} s",
        "exited": f"died after {o.at:.2f} s",
        "hung": f"still running at the {limit:g} s timeout; killed. Stack:",
        "killed": "still running after another rank failed; killed. Stack:",
    }[o.status]


def _emit_output(outcomes: list[RankOutcome]) -> None:
    """Print each rank's output in the test process, where pytest captures it for the report."""
    for o in outcomes:
        if o.output.strip():
            sys.stdout.write(f"----- rank {o.rank} output -----\n{o.output}")
            if not o.output.endswith("\n"):
                sys.stdout.write("\n")
    sys.stdout.flush()

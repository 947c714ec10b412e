"""Pool of pre-started worker processes, reused across distributed tests.

Starting a process that imports torch costs about a second; a test that needs four ranks would pay that
four times. Workers are therefore started once (from a forkserver that has torch preloaded, so each new
worker is a cheap fork) and handed back to the pool after every test that passed. A worker that took part
in a failed, hung or interrupted test is killed, never reused.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import time
from typing import Any

START_METHODS = ("forkserver", "spawn", "fork")
STARTUP_TIMEOUT_S = 180.0  # importing torch on a loaded 2-core CI machine can take tens of seconds
_STACK_WAIT_S = 1.0


class WorkerStartError(RuntimeError):
    """A worker process could not be started."""


class Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, folder: str, index: int) -> None:
        self.out_path = os.path.join(folder, f"worker{index}.out")
        self.dump_path = os.path.join(folder, f"worker{index}.stack")
        open(self.dump_path, "w").close()
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_entry,
            args=(child_conn, os.getpid(), self.out_path, self.dump_path),
            name=f"ds-test-worker-{index}",
        )
        self.proc.start()
        child_conn.close()
        self.pid: int = self.proc.pid

    def send(self, message: Any) -> None:
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> tuple:
        return pickle.loads(self.conn.recv_bytes())

    def output(self) -> str:
        return _read(self.out_path, 0)

    def dump_size(self) -> int:
        try:
            return os.path.getsize(self.dump_path)
        except OSError:
            return 0

    def stack_since(self, offset: int) -> str:
        return _read(self.dump_path, offset)

    def kill(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.join(5.0)
        self.conn.close()


def _worker_entry(*args: Any) -> None:
    # Imported here so that the test process itself need not import torch to use the harness.
    from _harness._worker import worker_main

    worker_main(*args)


def _read(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def default_start_method() -> str:
    method = os.environ.get("DS_TEST_START_METHOD", "")
    if method:
        if method not in START_METHODS:
            raise ValueError(f"DS_TEST_START_METHOD={method!r} is not one of {', '.join(START_METHODS)}")
        return method
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    if not raw.isdigit():
        raise ValueError(f"{name}={raw!r} must be a non-negative integer")
    return int(raw)


class WorkerPool:
    """Idle workers plus the means to start more; ``max_idle`` caps how many stay alive between tests."""

    def __init__(self, start_method: str | None = None, max_idle: int | None = None) -> None:
        self.start_method = start_method or default_start_method()
        self.max_idle = max_idle if max_idle is not None else _env_int("DS_TEST_POOL_IDLE", 4)
        self._ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Applies only if this process has not started the forkserver yet; otherwise workers still work
            # but import torch themselves. (Not "_harness._worker": Python 3.11's forkserver ignores the
            # parent's sys.path, so only site-packages modules can be preloaded.)
            self._ctx.set_forkserver_preload(["torch", "torch.distributed", "pytest", "_pytest.assertion.rewrite"])
        self._idle: list[Worker] = []
        self._folder: str | None = None
        self._count = 0
        self.started = 0  # workers started over the pool's life (tests assert on reuse with it)

    def prestart(self) -> None:
        """Start the forkserver (it imports torch in the background) so the first test waits less."""
        if self.start_method == "forkserver":
            from multiprocessing import forkserver

            forkserver.ensure_running()

    def idle_pids(self) -> list[int]:
        return [w.pid for w in self._idle]

    def acquire(self, n: int, startup_timeout: float = STARTUP_TIMEOUT_S) -> list[Worker]:
        """``n`` ready workers: idle ones first, the rest started now (in parallel)."""
        self._idle = [w for w in self._idle if _healthy(w)]
        # Most recently used first: those have the test modules imported and their caches warm.
        keep = max(len(self._idle) - n, 0)
        self._idle, taken = self._idle[:keep], self._idle[keep:]
        fresh: list[Worker] = []
        try:
            for _ in range(n - len(taken)):
                fresh.append(self._start())
            _await_ready(fresh, startup_timeout)
        except BaseException:
            for w in fresh + taken:
                w.kill()
            raise
        return taken + fresh

    def release(self, workers: list[Worker]) -> None:
        """Return workers of a passing test; beyond ``max_idle`` they are stopped."""
        self._idle.extend(workers)
        surplus = max(len(self._idle) - self.max_idle, 0)
        _stop(self._idle[:surplus])  # least recently used
        self._idle = self._idle[surplus:]

    def shutdown(self) -> None:
        idle, self._idle = self._idle, []
        _stop(idle)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _start(self) -> Worker:
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="ds-test-harness-")
        self._count += 1
        self.started += 1
        return Worker(self._ctx, self._folder, self._count)


def _healthy(w: Worker) -> bool:
    if not w.proc.is_alive() or w.conn.poll():  # an idle worker has nothing to say unless it died
        w.kill()
        return False
    return True


def _stop(workers: list[Worker], wait: float = 2.0) -> None:
    """Ask workers to exit, give them ``wait`` seconds together, then kill what is left."""
    for w in workers:
        try:
            w.send({"kind": "stop"})
        except OSError:
            pass
    deadline = time.monotonic() + wait
    for w in workers:
        w.proc.join(max(deadline - time.monotonic(), 0.0))
        w.kill()


def _await_ready(workers: list[Worker], timeout: float) -> None:
    waiting = {w.conn: w for w in workers}
    waiting.update({w.proc.sentinel: w for w in workers})
    pending = set(workers)
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerStartError(f"{len(pending)} worker process(es) not ready after {timeout:.0f} s")
        for obj in multiprocessing.connection.wait(list(waiting), timeout=left):
            w = waiting[obj]
            if w not in pending:
                continue
            if obj is w.conn and w.conn.poll():
                try:
                    kind, _pid = w.recv()
                except (EOFError, OSError):
                    kind = "eof"
                if kind == "ready":
                    pending.discard(w)
                    continue
            w.proc.join(1.0)
            raise WorkerStartError(
                f"worker process {w.pid} died while starting (exit code {w.proc.exitcode}); its output:\n"
                + w.output()
            )


def kill_with_stacks(workers: list[Worker]) -> dict[Worker, str]:
    """Kill ``workers``, first asking each live one for a faulthandler dump of all its threads."""
    alive = [w for w in workers if w.proc.is_alive()]
    before = {w: w.dump_size() for w in alive}
    for w in alive:
        try:
            os.kill(w.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _STACK_WAIT_S
    sizes = dict(before)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = {w: w.dump_size() for w in alive}
        # done when every dump has grown and stopped growing since the last look
        if all(now[w] > before[w] and now[w] == sizes[w] for w in alive):
            break
        sizes = now
    stacks = {w: w.stack_since(before[w]) for w in alive}
    for w in workers:
        w.kill()
    return stacks


_POOL: WorkerPool | None = None


def get_pool() -> WorkerPool:
    """The process-wide pool, created on first use and shut down at exit."""
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool()
        atexit.register(shutdown_pool)
    return _POOL


def shutdown_pool() -> None:
    """Stop every idle worker (the pool is re-created by the next distributed test)."""
    global _POOL
    if _POOL is not None:
        _POOL.shutdown()
        _POOL = None

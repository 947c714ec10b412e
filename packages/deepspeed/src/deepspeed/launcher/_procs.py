"""Run one node's ranks: spawn, prefix their output with the rank, forward signals, stop all on a failure.

Each rank runs in its own session (process group) so a signal reaches it once, from us, and stopping a rank
also stops anything it forked (data-loader workers). On Linux the ranks also get SIGKILL if the launcher
itself dies (``PR_SET_PDEATHSIG``), so a killed launcher leaves no orphans.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

_LINE_END = re.compile(rb"(\r\n|\r|\n)")
_POLL_S = 0.05
_PARTIAL_S = 0.2  # seconds of silence after which an unfinished line is shown
_PR_SET_PDEATHSIG = 1


@dataclass
class RankSpec:
    """One process to start: its global rank (for the output prefix), argv and environment."""

    rank: int
    cmd: list[str]
    env: dict[str, str]
    log_path: str | None = None
    cpus: tuple[int, ...] = ()  # CPU cores the rank is bound to (empty: no binding)


@dataclass
class _Rank:
    spec: RankSpec
    proc: subprocess.Popen
    pumps: list[threading.Thread] = field(default_factory=list)


def _load_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None


def _child_setup(cpus: tuple[int, ...]) -> Callable[[], None]:
    """What a rank runs between fork and exec: die with the launcher, bind to its cores. Syscalls only."""

    def setup() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


class _Prefixer:
    """Copies a child's byte stream to ``sink`` with ``prefix`` at every line start.

    Whole lines (ending in ``\n`` or ``\r``, so progress bars update) are written at once so ranks do not
    interleave mid-line; a partial line is written only after the child has been quiet for ``_PARTIAL_S``.
    """

    def __init__(self, prefix: bytes, sink: BinaryIO, lock: threading.Lock, log: BinaryIO | None):
        self.prefix, self.sink, self.lock, self.log = prefix, sink, lock, log
        self.pending = b""
        self.at_line_start = True

    def _emit(self, data: bytes) -> None:
        out = bytearray()
        for part in _LINE_END.split(data):
            if not part:
                continue
            is_end = _LINE_END.fullmatch(part) is not None
            # torch.distributed's excepthook already writes "[rankN]: " before each traceback line: keep one.
            if self.at_line_start and not is_end and not part.startswith(self.prefix):
                out += self.prefix
            out += part
            self.at_line_start = is_end
        with self.lock:
            try:
                self.sink.write(bytes(out))
                self.sink.flush()
            except (BrokenPipeError, ValueError):
                pass  # our stdout went away (e.g. `| head`): keep draining so the rank never blocks on a full pipe

    def feed(self, chunk: bytes) -> None:
        """Take a chunk; write every complete line now and keep the unfinished tail."""
        if self.log is not None:
            self.log.write(chunk)
            self.log.flush()
        data = self.pending + chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        self.pending = data[cut:]
        if cut:
            self._emit(data[:cut])

    def flush_partial(self) -> None:
        if self.pending:
            data, self.pending = self.pending, b""
            self._emit(data)

    def pump(self, fd: int) -> None:
        while True:
            ready, _, _ = select.select([fd], [], [], _PARTIAL_S)
            if not ready:
                self.flush_partial()
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            self.feed(chunk)
        self.flush_partial()
        os.close(fd)
        if self.log is not None:
            self.log.close()


def _start_rank(spec: RankSpec, prefix_output: bool) -> _Rank:
    popen_kw: dict = {"env": spec.env, "start_new_session": True}
    if _PRCTL is not None or spec.cpus:
        popen_kw["preexec_fn"] = _child_setup(spec.cpus)
    if prefix_output:
        popen_kw.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        return _Rank(spec, subprocess.Popen(spec.cmd, **popen_kw))
    except OSError as err:
        raise RuntimeError(f"cannot start rank {spec.rank}: {spec.cmd[0]!r}: {err.strerror}") from err


def _attach_pumps(rank: _Rank, lock: threading.Lock) -> None:
    # Threads start only after every rank is forked: fork + preexec_fn must not race other threads.
    spec, proc = rank.spec, rank.proc
    prefix = f"[rank{spec.rank}]: ".encode()
    for stream, sink, suffix in ((proc.stdout, sys.stdout.buffer, "out"), (proc.stderr, sys.stderr.buffer, "err")):
        log = open(f"{spec.log_path}.{suffix}", "ab") if spec.log_path else None
        fd = os.dup(stream.fileno())
        stream.close()
        thread = threading.Thread(target=_Prefixer(prefix, sink, lock, log).pump, args=(fd,), daemon=True)
        thread.start()
        rank.pumps.append(thread)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class RankGroup:
    """The ranks of one node, supervised together."""

    def __init__(self, specs: Sequence[RankSpec], prefix_output: bool = True, grace_s: float = 5.0):
        self.specs = list(specs)
        self.prefix_output = prefix_output
        self.grace_s = grace_s  # seconds a rank gets between SIGTERM and SIGKILL when we stop it
        self.ranks: list[_Rank] = []
        self._signal: int | None = None
        self.on_started: Callable[[RankGroup], object] | None = None  # called once every rank is forked

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._signal is None:
            self._signal = signum
        for rank in self.ranks:
            if rank.proc.poll() is None:
                _signal_group(rank.proc, signum)

    def stop(self, signum: int | None = signal.SIGTERM) -> None:
        """Send ``signum`` (None: nothing) to every live rank; SIGKILL those alive after the grace period."""
        for rank in self.ranks:
            if signum is not None and rank.proc.poll() is None:
                _signal_group(rank.proc, signum)
                _signal_group(rank.proc, signal.SIGCONT)  # a stopped (stalled) rank acts on it now, not at SIGKILL
        deadline = time.monotonic() + self.grace_s
        for rank in self.ranks:
            try:
                rank.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(rank.proc, signal.SIGKILL)
                rank.proc.wait()

    def run(self) -> int:
        """Start all ranks and wait; returns 0, the first failing rank's exit code, or 128+signal."""
        lock = threading.Lock()
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            for spec in self.specs:
                if self._signal is not None:
                    break
                self.ranks.append(_start_rank(spec, self.prefix_output))
            if self.on_started is not None:
                self.on_started(self)
            if self.prefix_output:
                for rank in self.ranks:
                    _attach_pumps(rank, lock)
            return self._wait()
        finally:
            self.stop()
            for rank in self.ranks:  # whatever a rank left behind in its process group goes too
                _signal_group(rank.proc, signal.SIGKILL)
            for rank in self.ranks:
                for thread in rank.pumps:
                    thread.join(timeout=2.0)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _wait(self) -> int:
        while True:
            alive = 0
            for rank in self.ranks:
                code = rank.proc.poll()
                if code is None:
                    alive += 1
                elif code != 0 and self._signal is None:
                    return self._fail(rank, code)
            if self._signal is not None:
                self.stop(None)  # the handler already forwarded the signal; give the ranks the grace period
                return 128 + self._signal
            if not alive:
                return 0
            time.sleep(_POLL_S)

    def _fail(self, failed: _Rank, code: int) -> int:
        how = f"exit code {code}" if code > 0 else f"signal {signal.Signals(-code).name}"
        sys.stderr.write(f"[launcher] rank {failed.spec.rank} (pid {failed.proc.pid}) failed with {how}; "
                         "stopping the other ranks\n")
        sys.stderr.flush()
        self.stop()
        return code if code > 0 else 128 - code

"""No rank worker outlives its test process, whether the pytest session is interrupted (Ctrl-C) or the
process is killed outright (checked in /proc); and what a failing rank looks like in pytest's own report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS_DIR = str(Path(__file__).resolve().parents[1])

_HANG_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from _harness import run_distributed

def announce_and_hang(folder):
    # the worker's own pid and its parent's (the forkserver) so the test can check both are gone
    with open(os.path.join(folder, f"pid{{os.getpid()}}"), "w") as fh:
        fh.write(str(os.getppid()))
    time.sleep(600)

if __name__ == "__main__":
    run_distributed(announce_and_hang, 2, args=(sys.argv[1],), timeout=300)
"""

# torch is imported in the ranks only: the inner session's own process then starts faster.
_INNER_TESTS = """
import os
import time

from _harness import distributed_test, run_distributed

def _record(folder, prefix="pid"):
    with open(os.path.join(folder, f"{prefix}{os.getpid()}"), "w") as fh:
        fh.write(str(os.getppid()))

def _fails_on_rank1(folder):
    import torch.distributed as dist
    _record(folder)
    print(f"output of rank {dist.get_rank()}")
    if dist.get_rank() == 1:
        raise RuntimeError("inner failure on rank one")

def _hangs(folder):
    _record(folder, "hang")
    time.sleep(600)

@distributed_test(world_size=[2], timeout=30)
def test_passes(folder):
    import torch
    import torch.distributed as dist
    _record(folder)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

def test_fails(folder):
    run_distributed(_fails_on_rank1, 2, args=(folder,), timeout=30)

def test_hangs_until_interrupted(folder):
    run_distributed(_hangs, 2, args=(folder,), timeout=300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _recorded(folder: Path, prefix: str = "pid") -> dict[int, int]:
    """pid -> parent pid (0 when not recorded) of every worker that announced itself in ``folder``."""
    return {int(p.name[len(prefix):]): int(p.read_text() or 0) for p in folder.glob(f"{prefix}*")}


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="checks processes through /proc")


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """The module's two child processes, started together so that their start-up (torch imports) overlaps."""
    folder = tmp_path_factory.mktemp("killed")
    script = folder / "hang.py"
    script.write_text(_HANG_SCRIPT.format(tests=TESTS_DIR))
    killed = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True)
    started = {"killed": (folder, killed)}
    folder = tmp_path_factory.mktemp("session")
    (folder / "test_inner.py").write_text(textwrap.dedent(_INNER_TESTS))
    fixture = f"import pytest\n\n@pytest.fixture\ndef folder():\n    return {str(folder)!r}\n"
    (folder / "conftest.py").write_text(fixture)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_harness.plugin",
           "--import-mode=importlib", "--rootdir", str(folder), "-c", os.devnull, str(folder / "test_inner.py")]
    session = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=folder)
    started["session"] = (folder, session)
    yield started
    for _, proc in started.values():
        proc.kill()
        proc.communicate()


def _assert_gone(workers: dict[int, int]) -> None:
    processes = [*workers, *set(workers.values())]  # the workers and the forkserver they were forked from
    assert _wait_until(lambda: not any(_alive(p) for p in processes), 5), "processes survived their test"


def test_interrupted_pytest_session_reports_failures_and_leaves_no_process(children):
    folder, proc = children["session"]
    assert _wait_until(lambda: len(_recorded(folder, "hang")) == 2, 90), "the hanging test did not start"
    proc.send_signal(signal.SIGINT)  # Ctrl-C while a distributed test runs
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2, out  # pytest: interrupted
    assert "KeyboardInterrupt" in out and "1 failed, 1 passed" in out
    assert "failed: rank 1 raised" in out and "RuntimeError: inner failure on rank one" in out
    assert 'raise RuntimeError("inner failure on rank one")' in out
    assert "----- rank 0 output -----" in out and "output of rank 1" in out  # captured rank output shown
    workers = _recorded(folder)
    assert len(workers) == 2  # the passing test's workers were reused by the failing one, then killed
    _assert_gone(workers | _recorded(folder, "hang"))


def test_killed_test_process_leaves_no_process(children):
    folder, proc = children["killed"]
    assert _wait_until(lambda: len(_recorded(folder)) == 2, 90), "workers did not start"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    _assert_gone(_recorded(folder))

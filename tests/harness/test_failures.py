"""Failing ranks: the failure names the rank and carries its traceback, exit code or stack; the workers of a
failed test are gone (checked in /proc) and the next distributed test passes."""

from __future__ import annotations

import faulthandler
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from _harness import DistributedTestFailure, DistributedTimeout, get_pool, run_distributed


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def assert_all_gone(pids: list[int], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, f"worker processes {alive} survived"


def _sum_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def assert_pool_healthy(failure: DistributedTestFailure) -> None:
    """The failed test's workers are dead, none of them is reused, and a 2-rank test passes right after."""
    pids = [o.pid for o in failure.ranks.values()]
    assert_all_gone(pids)
    assert not set(pids) & set(get_pool().idle_pids())
    assert run_distributed(_sum_ranks, 2, timeout=30) == [1.0, 1.0]


def _raise_on_rank1(message: str) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        print("rank one says hello before failing")
        raise ValueError(message)
    dist.all_reduce(t)  # rank 0 waits here for a peer that is gone: killed after the grace period


def test_raising_rank_traceback_is_the_failure(capsys):
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_raise_on_rank1, 2, args=("boom from the body",), timeout=30)
    text = str(info.value)
    assert text.splitlines()[0].endswith("failed: rank 1 raised")
    assert "Traceback (most recent call last)" in text and "ValueError: boom from the body" in text
    assert "in _raise_on_rank1" in text and 'raise ValueError(message)' in text
    assert info.value.ranks[1].status == "raised" and info.value.ranks[0].status == "killed"
    assert "still running after another rank failed" in text
    assert "rank one says hello before failing" in capsys.readouterr().out
    assert_pool_healthy(info.value)


def _failed_assert() -> None:
    value = dist.get_rank() + 40
    assert value == 42, "rank sum is off"


def test_assertions_in_ranks_show_their_values():
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_failed_assert, 2, timeout=30)
    text = str(info.value)
    assert "AssertionError: rank sum is off" in text
    assert "assert 40 == 42" in text and "assert 41 == 42" in text  # pytest's rewriting ran in the ranks
    assert {o.status for o in info.value.ranks.values()} == {"raised"}
    assert_pool_healthy(info.value)


def _hang_on_rank1() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def test_hung_rank_is_killed_at_the_timeout_with_its_stack():
    start = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        run_distributed(_hang_on_rank1, 2, timeout=2)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert 2.0 <= elapsed < 10.0
    assert "timed out after 2 s; ranks 0, 1 still running (killed)" in text
    assert "in _hang_on_rank1" in text  # faulthandler dump of every thread of the hung ranks...
    assert "_watch_parent" not in text and "_worker.py" not in text  # ...without the harness's own frames
    assert text.count("still running at the 2 s timeout; killed. Stack:") == 2
    assert {o.status for o in info.value.ranks.values()} == {"hung"}
    assert_pool_healthy(info.value)


def _exit_on_rank1(how: str) -> None:
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(1)
        elif how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            faulthandler._sigsegv()
    dist.barrier()


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("exit", "rank 1 exited with code 1 without reporting a result"),
        ("sigkill", "rank 1 killed by SIGKILL (exit code -9)"),
        ("segfault", "rank 1 killed by SIGSEGV (exit code -11)"),
    ],
    ids=["os._exit", "sigkill", "segfault"],
)
def test_dying_rank_is_reported_with_its_exit_code(how, expected):
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_exit_on_rank1, 2, args=(how,), timeout=30)
    text = str(info.value)
    assert expected in text.splitlines()[0]
    assert info.value.ranks[1].status == "exited"
    assert info.value.ranks[0].status in ("killed", "raised")  # gloo may notice the lost peer first
    if how == "segfault":  # faulthandler's crash report names the Python frame that crashed
        assert "Segmentation fault" in text and "in _exit_on_rank1" in text
    assert_pool_healthy(info.value)


def _unpicklable_result():
    return lambda: None


def test_unpicklable_return_value_is_a_failure():
    with pytest.raises(DistributedTestFailure, match="cannot be pickled") as info:
        run_distributed(_unpicklable_result, 1, timeout=30)
    assert_pool_healthy(info.value)

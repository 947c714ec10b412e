"""SIGKILL and SIGSTOP of one rank of a 2-rank ZeRO-1 job, in forward, backward, step, save and load.

The job (``_job.py``) runs under the project's launcher (``python -m deepspeed.launcher.launch``, what the
``deepspeed`` command runs per node) or bare (two processes with the launcher's variables, as torchrun or a
scheduler would start them, so the survivor must fail by itself). Its process-group timeout is
``DEEPSPEED_TIMEOUT`` = 0.15 min (9 s). For each case: every process is gone within the stated bound after the
fault, the output names the failed rank and the cause, and the checkpoint saved before the fault (tag ``good``,
still the one ``latest`` names) loads on 2 ranks with every parameter bitwise equal to what was saved.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _harness import run_distributed
from _sibling import load_sibling

_job = load_sibling(__file__, "_job.py", "_faults_job")
_record = load_sibling(__file__, "_record.py", "_faults_record")

JOB = str(Path(__file__).with_name("_job.py"))
ROOT = Path(__file__).resolve().parents[2]
PG_TIMEOUT_S = 9.0
# A dead rank: the launcher sees the exit within its 0.05 s poll and stops the rest; a bare survivor sees the
# closed connection in its next collective, or the checkpoint meeting's timeout in a save/load. Slack for a
# loaded 2-core machine (process teardown, interpreter exit).
KILL_BOUND_S = 15.0
STALL_BOUND_S = PG_TIMEOUT_S + 15.0  # a stopped rank: the survivor's collective times out, then as above
TIMEOUT_SCALE = float(os.environ.get("DS_TEST_TIMEOUT_SCALE", "1"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, DEEPSPEED_TIMEOUT=str(PG_TIMEOUT_S / 60), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DS_CHECKPOINT_TIMEOUT", None)  # the checkpoint meetings wait as long as the process group
    return env


def _fault_time(work: Path) -> float:
    stamp = work / "fault_at"
    assert stamp.exists(), "the victim never reached its fault"
    return float(stamp.read_text())


def _launch(work: Path, kind: str, phase: str, victim: int) -> tuple[int, str, float]:
    """Run the job under the launcher; returns (exit code, its output, seconds from the fault to the exit)."""
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    cmd = [sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world}",
           f"--master_port={_free_port()}", JOB, str(work), kind, phase, str(victim)]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120 * TIMEOUT_SCALE)
    ended = time.time()
    return done.returncode, done.stdout + done.stderr, ended - _fault_time(work)


def _bare(work: Path, kind: str, phase: str, victim: int) -> tuple[str, float]:
    """Start both ranks directly; returns (the survivor's error, seconds from the fault to its exit)."""
    port, procs = _free_port(), []
    try:
        for rank in (0, 1):
            env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            procs.append(subprocess.Popen([sys.executable, JOB, str(work), kind, phase, str(victim)], cwd=ROOT,
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        survivor = procs[1 - victim]
        out, _ = survivor.communicate(timeout=120 * TIMEOUT_SCALE)
        ended = time.time()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.communicate()
    report = work / f"error_r{1 - victim}.txt"
    assert survivor.returncode == 1 and report.exists(), out.decode(errors="replace")[-4000:]
    error = report.read_text()
    return error, ended - _fault_time(work)


def _load_good(work: str) -> bool:
    from deepspeed.runtime.checkpointing import read_latest

    engine = _job.build_engine(seed=7)  # other weights: everything must come from the checkpoint
    assert read_latest(os.path.join(work, "ckpt")) == "good"
    engine.load_checkpoint(os.path.join(work, "ckpt"))
    saved = torch.load(os.path.join(work, f"good_r{torch.distributed.get_rank()}.pt"), weights_only=True)
    assert engine.global_steps == 2
    return all(torch.equal(v, saved[k]) for k, v in engine.module.state_dict().items())


def _assert_good_checkpoint_loads(work: Path) -> str:
    assert run_distributed(_load_good, world_size=2, args=(str(work),), timeout=90) == [True, True]
    return "tag `good` (saved before the fault, still in `latest`) loads bitwise on 2 ranks"


@pytest.mark.parametrize("phase", ["forward", "backward", "step", "save", "load"])
def test_sigkill_of_one_rank_under_the_launcher(tmp_path, phase):
    rc, out, seconds = _launch(tmp_path, "sigkill", phase, victim=1)
    line = next((x for x in out.splitlines() if x.startswith("[launcher]")), "")
    assert "rank 1 (pid" in line and "failed with signal SIGKILL; stopping the other ranks" in line, out[-3000:]
    assert rc == 128 + signal.SIGKILL
    assert seconds < KILL_BOUND_S
    preserved = _assert_good_checkpoint_loads(tmp_path)
    if phase == "save":
        assert not (tmp_path / "ckpt" / "next" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()
    _record.record(f"SIGKILL of rank 1 during {phase} (launcher)", line, seconds, f"< {KILL_BOUND_S:g} s", preserved)


@pytest.mark.parametrize("phase,victim", [("forward", 1), ("backward", 1), ("step", 1), ("backward", 0),
                                          ("save", 1), ("save", 0), ("load", 1)])
def test_sigkill_of_one_rank_bare_survivor_raises(tmp_path, phase, victim):
    error, seconds = _bare(tmp_path, "sigkill", phase, victim)
    assert seconds < KILL_BOUND_S + (PG_TIMEOUT_S if phase in ("save", "load") else 0)
    if phase in ("save", "load") and victim == 0:  # the meeting's store died with rank 0's process
        assert error.startswith(f"CheckpointSyncError: {phase}_checkpoint on rank 1: "), error
        assert "rank 0: unknown (the group's store, served by rank 0's process, is unreachable)" in error, error
        bound = f"checkpoint timeout ({PG_TIMEOUT_S:g} s) + {KILL_BOUND_S:g} s"
    elif phase in ("save", "load"):  # the checkpoint meeting names who never finished, and why
        assert f"ranks [{victim}] did not finish" in error, error
        assert f"rank {victim} (pid" in error and ("is gone (killed or exited)" in error or "has died" in error), error
        assert "not only rank 0" not in error, error  # it did call it: it died
        bound = f"checkpoint timeout ({PG_TIMEOUT_S:g} s) + {KILL_BOUND_S:g} s"
    else:
        # ZeRO-1's forward has no collective: a kill there surfaces in the survivor's backward
        first = "backward" if phase == "forward" else phase
        assert error.startswith(f"PeerFailureError: rank {1 - victim}, {first} at global_steps=2"), error
        bound = f"< {KILL_BOUND_S:g} s"
        if victim == 1:
            assert "rank 1 (pid" in error and ("is gone (killed or exited)" in error or "has died" in error), error
        else:  # rank 0 served the store: the survivor can only say that rank 0 is unreachable
            assert "rank 0: unknown (the group's store, served by rank 0's process, is unreachable)" in error, error
    preserved = _assert_good_checkpoint_loads(tmp_path)
    _record.record(f"SIGKILL of rank {victim} during {phase} (no launcher: the survivor's own error)", error,
                   seconds, bound, preserved)


def test_sigstop_of_one_rank_under_the_launcher(tmp_path):
    rc, out, seconds = _launch(tmp_path, "sigstop", "forward", victim=1)
    assert "rank 1 (pid" in out and "is stopped (SIGSTOP/SIGTSTP)" in out, out[-3000:]
    assert "[launcher] rank 0" in out and rc == 1, out[-3000:]
    assert PG_TIMEOUT_S - 1 < seconds < STALL_BOUND_S
    preserved = _assert_good_checkpoint_loads(tmp_path)
    seen = next(x for x in out.splitlines() if "PeerFailureError: rank 0" in x)
    _record.record("SIGSTOP of rank 1 during forward (a stall; launcher)", seen, seconds,
                   f"process-group timeout ({PG_TIMEOUT_S:g} s) + {STALL_BOUND_S - PG_TIMEOUT_S:g} s", preserved)


@pytest.mark.parametrize("phase", ["backward", "save"])
def test_sigstop_of_one_rank_bare_survivor_raises(tmp_path, phase):
    error, seconds = _bare(tmp_path, "sigstop", phase, victim=1)
    if phase == "save":
        assert "ranks [1] did not finish writing" in error, error
        assert "rank 1 (pid" in error and "is stopped (SIGSTOP/SIGTSTP)" in error, error
    else:
        assert error.startswith("PeerFailureError: rank 0, backward at global_steps=2"), error
        assert "rank 1 (pid" in error and "is stopped (SIGSTOP/SIGTSTP)" in error, error
        assert f"process-group timeout ({PG_TIMEOUT_S:g} s" in error, error
    assert PG_TIMEOUT_S - 1 < seconds < STALL_BOUND_S
    preserved = _assert_good_checkpoint_loads(tmp_path)
    _record.record(f"SIGSTOP of rank 1 during {phase} (a stall; no launcher)", error, seconds,
                   f"timeout ({PG_TIMEOUT_S:g} s) + {STALL_BOUND_S - PG_TIMEOUT_S:g} s", preserved)


def _load_good_pipe(work: str) -> bool:
    engine = _job.build_pipe_engine(seed=7)
    engine.load_checkpoint(os.path.join(work, "ckpt"), tag="good")
    saved = torch.load(os.path.join(work, f"good_r{torch.distributed.get_rank()}.pt"), weights_only=True)
    return engine.global_steps == 2 and all(torch.equal(v, saved[k]) for k, v in engine.module.state_dict().items())


@pytest.mark.parametrize("victim", [1, 0])
def test_sigkill_of_one_pipeline_stage_during_train_batch(tmp_path, victim):
    error, seconds = _bare(tmp_path, "sigkill", "train_batch", victim)
    assert error.startswith(f"PeerFailureError: rank {1 - victim}, train_batch at global_steps=2"), error
    if victim == 1:
        assert "rank 1 (pid" in error and ("is gone (killed or exited)" in error or "has died" in error), error
    else:  # rank 0 served the store
        assert "rank 0: unknown (the group's store, served by rank 0's process, is unreachable)" in error, error
    assert seconds < KILL_BOUND_S
    assert run_distributed(_load_good_pipe, world_size=2, args=(str(tmp_path),), timeout=90) == [True, True]
    _record.record(f"SIGKILL of pipeline stage {victim} (rank {victim}) during train_batch (no launcher: the "
                   "survivor's own error)", error, seconds, f"< {KILL_BOUND_S:g} s",
                   "tag `good` (saved before the fault) loads bitwise on 2 ranks")

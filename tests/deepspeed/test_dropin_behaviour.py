"""Drop-in fidelity (issue 18), end to end: a 2-process CPU job sees 2 CPU devices (DeepSpeed's LOCAL_SIZE
rule), ``engine.save_checkpoint`` with a bad ``save_dir`` fails on every rank without waiting, and
``tag_validation: Fail`` raises the ``AssertionError`` DeepSpeed's ``assert`` raises."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
          "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}

DEVICE_COUNT = """
import os
from deepspeed.accelerator import get_accelerator
accel = get_accelerator()
print(f"rank={os.environ['RANK']} name={accel.name} devices={accel.device_count()} "
      f"current={accel.current_device()}", flush=True)
"""


@pytest.mark.timeout(120)
def test_two_process_cpu_job_sees_two_devices(tmp_path):
    (tmp_path / "script.py").write_text(DEVICE_COUNT)
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_procs=2", "--master_port=0", "script.py"]
    if os.path.exists("/job/hostfile"):
        pytest.skip("a real /job/hostfile would be used")
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    lines = sorted(line.split(": ", 1)[-1] for line in out.stdout.splitlines() if "devices=" in line)
    assert lines == [f"rank={r} name=cpu devices=2 current={r}" for r in (0, 1)]  # LOCAL_SIZE=2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _engine(config: dict):
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    loss = engine(torch.ones(2, 3)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine


def _bad_save_dir_body(save_dir: str, bad_ranks: tuple[int, ...], bad_value: str | None) -> tuple:
    os.environ["DS_CHECKPOINT_TIMEOUT"] = "30"
    try:
        engine = _engine(CONFIG)
        start = time.monotonic()
        try:
            engine.save_checkpoint(bad_value if dist.get_rank() in bad_ranks else save_dir)
        except ValueError as exc:
            outcome = (type(exc).__name__, str(exc), time.monotonic() - start)
        else:
            outcome = ("saved", "", 0.0)
        engine.save_checkpoint(save_dir, tag="after")  # the group still meets afterwards
    finally:
        del os.environ["DS_CHECKPOINT_TIMEOUT"]
    return outcome


@pytest.mark.parametrize("bad_ranks, bad_value", [((0, 1), None), ((0, 1), ""), ((0,), None)])
def test_engine_save_checkpoint_bad_save_dir_fails_every_rank(tmp_path, bad_ranks, bad_value):
    # DeepSpeed: rank 0 fails in makedirs(None) while the others wait in dist.barrier() for ever.
    results = run_distributed(_bad_save_dir_body, world_size=2, args=(str(tmp_path), bad_ranks, bad_value),
                              timeout=90)
    for rank, (kind, message, elapsed) in enumerate(results):
        assert kind == "ValueError" and elapsed < 10, (rank, message)
        assert f"save_dir={bad_value!r} is invalid" in message
        if rank not in bad_ranks:
            assert f"ranks {list(bad_ranks)} were called with invalid arguments" in message
    assert sorted(os.listdir(tmp_path)) == ["after", "latest"]


def test_engine_save_checkpoint_alone_is_a_value_error():
    outcome = run_distributed(_single_rank_bad_save, world_size=1, args=(), timeout=60)[0]
    assert outcome == "ValueError: save_checkpoint: save_dir=None is invalid"


def _single_rank_bad_save() -> str:
    engine = _engine(CONFIG)
    try:
        engine.save_checkpoint(None)
    except ValueError as exc:
        return f"ValueError: {str(exc).split(';')[0]}"
    return "saved"


def _tag_fail_body(save_dir: str) -> tuple[str, bool]:
    engine = _engine({**CONFIG, "checkpoint": {"tag_validation": "Fail"}})
    try:
        engine.save_checkpoint(save_dir, tag=f"step1_rank{dist.get_rank()}")
    except AssertionError as exc:  # what DeepSpeed's `assert valid, msg` raises
        return type(exc).__name__, "is not consistent across all ranks" in str(exc)
    return "saved", False


def test_engine_tag_validation_fail_is_an_assertion_error(tmp_path):
    results = run_distributed(_tag_fail_body, world_size=2, args=(str(tmp_path),), timeout=90)
    assert results == [("CheckpointTagError", True), ("CheckpointTagError", True)]
    assert not list(Path(tmp_path).iterdir())  # nobody wrote

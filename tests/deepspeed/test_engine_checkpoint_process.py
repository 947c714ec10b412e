"""Checkpoints at the engine level, across processes: 10 steps, ``engine.save_checkpoint``, load in a fresh
process, 10 more == 20 straight (bitwise, CPU fp32); and a training process built by ``deepspeed.initialize``
SIGKILLed in the middle of ``engine.save_checkpoint`` leaves the previous checkpoint loadable, bit for bit,
through ``engine.load_checkpoint`` in another process, and training goes on from it.

The children are this file run as a script (``python test_engine_checkpoint_process.py <dir> <role>``); a
killed child patches its own writer to stop at the chosen place, touches a marker file and waits to be killed.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.abspath(__file__)
CONFIG = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.01}}}


def _engine(seed: int):
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    return deepspeed.initialize(model=model, config=CONFIG)[0]


def _train(engine, steps: int) -> None:
    for _ in range(steps):  # batches depend on the step number only
        gen = torch.Generator().manual_seed(engine.global_steps)
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def _block_forever(work: str) -> None:
    open(os.path.join(work, "blocked"), "w").close()
    time.sleep(120)


def _launcher_env() -> None:
    with socket.socket() as s:  # a one-rank group on a free port, as the launcher would set up
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _snapshot(engine) -> dict:
    return {"module": engine.module.state_dict(), "lr": engine.get_lr(), "steps": engine.global_steps,
            "samples": engine.global_samples}


def _child_resume(work: str) -> None:
    engine = _engine(seed=123)
    path, client = engine.load_checkpoint(os.path.join(work, "ckpt"))
    assert path is not None and client["epoch"] == 1, path
    _train(engine, 10)
    torch.save(_snapshot(engine), os.path.join(work, "resumed.pt"))


def _save_after_10(work: str) -> None:
    engine = _engine(seed=0)
    _train(engine, 10)
    engine.save_checkpoint(os.path.join(work, "ckpt"), client_state={"epoch": 1})


def _straight_20() -> dict:
    engine = _engine(seed=0)
    _train(engine, 20)
    return _snapshot(engine)


def _run_child(work: str, role: str) -> None:
    done = subprocess.run([sys.executable, HERE, work, role], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr


def test_engine_resume_in_a_new_process_equals_a_straight_run(tmp_path):
    from _harness import run_distributed

    straight = run_distributed(_straight_20, world_size=1, timeout=60)[0]
    run_distributed(_save_after_10, world_size=1, args=(str(tmp_path),), timeout=60)
    _run_child(str(tmp_path), "resume")
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert resumed["steps"] == 20 and resumed["samples"] == 80 and resumed["lr"] == straight["lr"]
    assert resumed["module"].keys() == straight["module"].keys()
    for key, value in straight["module"].items():
        assert torch.equal(resumed["module"][key], value), key


def _child_killed(work: str, where: str) -> None:
    engine = _engine(seed=0)
    _train(engine, 2)
    engine.save_checkpoint(os.path.join(work, "ckpt"))
    torch.save(engine.module.state_dict(), os.path.join(work, "expected.pt"))
    _train(engine, 1)
    if where == "model_states":  # stop with half of the first file written to its temporary name
        real_save = torch.save

        def half_save(obj, handle):
            buffer = io.BytesIO()
            real_save(obj, buffer)
            handle.write(buffer.getvalue()[: buffer.tell() // 2])
            handle.flush()
            _block_forever(work)

        torch.save = half_save
    else:  # stop when the new tag is complete, just before 'latest' moves
        from deepspeed.runtime.checkpointing import LATEST_FILE

        real_replace = os.replace

        def blocking_replace(src, dst):
            if os.path.basename(dst) == LATEST_FILE:
                _block_forever(work)
            real_replace(src, dst)

        os.replace = blocking_replace
    engine.save_checkpoint(os.path.join(work, "ckpt"))


def _resume_body(work: str) -> dict:
    engine = _engine(seed=7)  # different weights: everything must come from the checkpoint
    path, _ = engine.load_checkpoint(os.path.join(work, "ckpt"))
    expected = torch.load(os.path.join(work, "expected.pt"), weights_only=True)
    equal = all(torch.equal(v, expected[k]) for k, v in engine.module.state_dict().items())
    steps = engine.global_steps
    _train(engine, 1)
    engine.save_checkpoint(os.path.join(work, "ckpt"))  # replaces the stale temporary, moves 'latest'
    return {"path": path, "equal": equal, "steps": steps}


@pytest.mark.parametrize("where", ["model_states", "latest"])
def test_engine_killed_during_save_keeps_the_previous_checkpoint(tmp_path, where):
    from _checkpoint_testing import sigkill_when_blocked
    from _harness import run_distributed

    from deepspeed.runtime.checkpointing import read_latest

    child = subprocess.Popen([sys.executable, HERE, str(tmp_path), where], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    sigkill_when_blocked(child, tmp_path / "blocked", timeout=90)
    save_dir = tmp_path / "ckpt"
    assert read_latest(save_dir) == "global_step2"
    if where == "model_states":
        assert not (save_dir / "global_step3" / "mp_rank_00_model_states.pt").exists()
    r = run_distributed(_resume_body, world_size=1, args=(str(tmp_path),), timeout=60)[0]
    assert r == {"path": str(save_dir / "global_step2" / "mp_rank_00_model_states.pt"), "equal": True, "steps": 2}
    assert read_latest(save_dir) == "global_step3"


if __name__ == "__main__":
    _launcher_env()
    if sys.argv[2] == "resume":
        _child_resume(sys.argv[1])
    else:
        _child_killed(sys.argv[1], sys.argv[2])

"""Checkpoints across real processes: resume exactness in a fresh process, SIGKILL in the middle of a save.

The children are this file run as a script (``python test_checkpointing_process.py <role> <dir>``), so the
test needs no helper module and the kill point is injected deterministically: the child patches its own
file writer to stop at a chosen place, touches a marker file, and waits to be killed.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pytest
import torch

import deepspeed.runtime.checkpointing as ckpt

HERE = os.path.abspath(__file__)


def _state(seed: int, total_steps: int = 20) -> ckpt.EngineState:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                 torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(module.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total_steps)
    return ckpt.EngineState(module=module, optimizer=optimizer, lr_scheduler=scheduler,
                            ds_config={"train_batch_size": 8})


def _train(state: ckpt.EngineState, steps: int) -> None:
    """Plain torch loop; batches depend on the step number, dropout on the global torch RNG."""
    for _ in range(steps):
        gen = torch.Generator().manual_seed(state.counters.global_steps)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(state.module(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.lr_scheduler.step()
        state.counters.global_steps += 1
        state.counters.global_samples += 8


def _snapshot(state: ckpt.EngineState) -> dict:
    return {"module": state.module.state_dict(), "optimizer": state.optimizer.state_dict(),
            "scheduler": state.lr_scheduler.state_dict(), "steps": state.counters.global_steps,
            "samples": state.counters.global_samples, "rng": torch.get_rng_state()}


def _child_resume(work: str) -> None:
    resumed = _state(seed=123)  # different initial weights: everything must come from the checkpoint
    _, client = ckpt.load_checkpoint(resumed, os.path.join(work, "ckpt"))
    torch.set_rng_state(client["rng"])
    _train(resumed, 10)
    torch.save(_snapshot(resumed), os.path.join(work, "resumed.pt"))


def _block_forever(work: str) -> None:
    open(os.path.join(work, "blocked"), "w").close()
    time.sleep(120)


def _child_killed_during_save(work: str, where: str) -> None:
    state = _state(seed=0)
    _train(state, 2)
    ckpt.save_checkpoint(state, os.path.join(work, "ckpt"))
    torch.save(state.module.state_dict(), os.path.join(work, "expected.pt"))
    _train(state, 1)
    if where == "model_states":  # stop with half the file written to its temporary name
        real_save = torch.save

        def half_save(obj, handle):
            buffer = io.BytesIO()
            real_save(obj, buffer)
            handle.write(buffer.getvalue()[: buffer.tell() // 2])
            handle.flush()
            _block_forever(work)

        torch.save = half_save
    else:  # stop after the tag directory is complete and 'latest' is written but not yet renamed
        real_replace = os.replace

        def blocking_replace(src, dst):
            if os.path.basename(dst) == ckpt.LATEST_FILE:
                _block_forever(work)
            real_replace(src, dst)

        os.replace = blocking_replace
    ckpt.save_checkpoint(state, os.path.join(work, "ckpt"))


def _run_child(*args: str, timeout: float = 60) -> None:
    done = subprocess.run([sys.executable, HERE, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr



@pytest.fixture
def one_thread():
    """The child runs single-threaded; so does this process while it computes the reference."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_resume_in_a_new_process_equals_a_straight_run(tmp_path, one_thread):
    from _checkpoint_testing import assert_same_tensors  # tests/ is on sys.path under pytest

    straight = _state(seed=0)
    _train(straight, 20)
    straight = _snapshot(straight)
    first = _state(seed=0)
    _train(first, 10)
    ckpt.save_checkpoint(first, tmp_path / "ckpt", client_state={"rng": torch.get_rng_state()})
    _run_child("resume", str(tmp_path))
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert resumed["steps"] == 20 and resumed["samples"] == 160
    assert_same_tensors(resumed, straight)  # weights, Adam moments, OneCycle position, RNG: bit for bit


@pytest.mark.parametrize("where", ["model_states", "latest"])
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, where):
    from _checkpoint_testing import assert_same_tensors, sigkill_when_blocked  # tests/ is on sys.path under pytest

    child = subprocess.Popen([sys.executable, HERE, "killed", str(tmp_path), where],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    sigkill_when_blocked(child, tmp_path / "blocked", timeout=60)
    save_dir = tmp_path / "ckpt"
    assert ckpt.read_latest(save_dir) == "global_step2"
    leftovers = [name for name in os.listdir(save_dir / ("global_step3" if where == "model_states" else ""))
                 if ".tmp-" in name]
    assert len(leftovers) == 1  # the killed writer's temporary, never under the final name
    if where == "model_states":
        assert not (save_dir / "global_step3" / "mp_rank_00_model_states.pt").exists()
    else:  # the new tag itself is complete; only 'latest' did not move
        assert ckpt.load_checkpoint(_state(seed=5), save_dir, tag="global_step3")[0] is not None
    restored = _state(seed=7)
    path, _ = ckpt.load_checkpoint(restored, save_dir)
    assert path == str(save_dir / "global_step2" / "mp_rank_00_model_states.pt")
    assert_same_tensors(restored.module.state_dict(), torch.load(tmp_path / "expected.pt", weights_only=True))
    assert restored.counters.global_steps == 2
    _train(restored, 1)
    ckpt.save_checkpoint(restored, save_dir)  # the next save replaces the stale temporary and moves 'latest'
    assert ckpt.read_latest(save_dir) == "global_step3"
    for folder in (save_dir, save_dir / "global_step3"):
        assert not [name for name in os.listdir(folder) if ".tmp-" in name]


if __name__ == "__main__":
    torch.set_num_threads(1)  # same kernels in every child, so runs compare bit for bit
    role, work_dir, *rest = sys.argv[1:]
    {"resume": _child_resume, "killed": _child_killed_during_save}[role](work_dir, *rest)

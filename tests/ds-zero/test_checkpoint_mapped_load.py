"""ZeRO checkpoints are read memory-mapped (``load.mapped``), and nothing of the mapping outlives the load.

Reading maps the files and copies their tensors into the live partitions and optimizer state (no fresh
allocation, no second read of a file the check phase already read). The engine must own everything it keeps: the
test overwrites every file of the loaded tag in place (same inode, so a private mapping that was still in use
would show the new bytes) and checks that the weights, fp32 masters, Adam moments and client state are unchanged
and that the optimizer state tensors are the ones the engine had before the load.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _engine(stage: int):
    import deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}
    return deepspeed.initialize(model=Net(), config=config)[0]


def _train(engine, steps: int) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = engine(torch.randn(4, 16, generator=gen)).square().mean()
        engine.backward(loss)
        engine.step()


def _optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    out = {}
    for g, group in enumerate(engine.optimizer.groups):
        out[f"master{g}"] = group.master
        for key, value in engine.optimizer.optimizer.state.get(group.master, {}).items():
            if torch.is_tensor(value):
                out[f"{key}{g}"] = value
    return out


def _values(engine, client: dict) -> dict[str, torch.Tensor]:
    out = {f"opt.{k}": v.detach().clone() for k, v in _optimizer_tensors(engine).items()}
    out.update({f"module.{k}": v.detach().clone() for k, v in engine.module.named_parameters()})
    out["client"] = client["extra"].clone()
    return out


def _load_then_overwrite(stage: int, save_dir: str) -> dict:
    engine = _engine(stage)
    _train(engine, 2)
    engine.save_checkpoint(save_dir, tag="t", client_state={"extra": torch.arange(1000.0)})
    _train(engine, 1)  # the live state moves on: the load must bring back the saved one
    before = {k: v.data_ptr() for k, v in _optimizer_tensors(engine).items()}
    _, client = engine.load_checkpoint(save_dir, tag="t")
    loaded = _values(engine, client)
    same_memory = {k: v.data_ptr() for k, v in _optimizer_tensors(engine).items()} == before
    dist.barrier()
    if dist.get_rank() == 0:
        tag_dir = os.path.join(save_dir, "t")
        for name in os.listdir(tag_dir):
            path = os.path.join(tag_dir, name)
            with open(path, "r+b") as handle:  # in place: a live private mapping would see these bytes
                handle.write(b"\x7f" * os.path.getsize(path))
    dist.barrier()
    after = _values(engine, client)
    changed = [k for k in loaded if not torch.equal(loaded[k], after[k])]
    return {"same_memory": same_memory, "changed": changed, "client": loaded["client"],
            "masters_finite": all(torch.isfinite(v).all().item() for k, v in after.items() if k.startswith("opt."))}


@pytest.mark.parametrize("stage", [2, 3])
def test_loaded_state_owns_its_memory(tmp_path, stage):
    for rank in run_distributed(_load_then_overwrite, world_size=2, args=(stage, str(tmp_path)), timeout=90):
        assert rank["changed"] == []
        assert rank["same_memory"], "the optimizer state tensors were replaced instead of loaded into"
        assert torch.equal(rank["client"], torch.arange(1000.0))
        assert rank["masters_finite"]

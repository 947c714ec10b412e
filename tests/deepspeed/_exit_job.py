"""A short 2-rank job for the clean-exit checks (``test_clean_exit.py``, ``benchmarks/clean_exit.py``): trains a
tiny model two steps with ZeRO-2, ZeRO-3, ZeRO-3 on NVMe, a 2-stage pipeline or a 2-expert MoE layer (``kind``),
prints ``DONE <rank>`` and ends without destroying its process groups, as training scripts do. ``inflight``:
leaves collectives of a group held by a module-level table running at exit (the sharpest form of the race
``deepspeed.comm._exit`` closes). ``--destroy-only``: the baseline, the exit hook as it was before (destroy the
registered groups only, leaving those that references keep alive, and their threads, to finalisation).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python tests/deepspeed/_exit_job.py zero3
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import deepspeed
import deepspeed.comm
from deepspeed.comm._exit import end_process_groups

KINDS = ("zero2", "zero3", "nvme", "pipe", "moe")
DIM = 8
GROUPS: list = []  # a library's table of groups, for "inflight"


def _config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, **extra}


class _MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(DIM, nn.Linear(DIM, DIM), num_experts=2, ep_size=2, k=1, min_capacity=0)
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, aux, _ = self.moe(x)
        return self.out(h) + 0 * aux


def _model_and_config(kind: str, scratch: str) -> tuple[nn.Module, dict]:
    if kind == "moe":
        return _MoENet(), _config()
    zero: dict = {"stage": 2 if kind == "zero2" else 3}
    if kind == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": scratch}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": scratch}
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1)), _config(zero_optimization=zero)


def _train(kind: str, scratch: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(2, DIM), torch.randn(2, 1)
    if kind == "pipe":
        from deepspeed.pipe import LayerSpec, PipelineModule

        specs = [LayerSpec(nn.Linear, DIM, DIM), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, DIM, 1)]
        engine, *_ = deepspeed.initialize(model=PipelineModule(specs, num_stages=2, loss_fn=nn.MSELoss()),
                                          config=_config())
        for _ in range(2):
            engine.train_batch(iter([(x, y)] * 4))
        return
    model, config = _model_and_config(kind, scratch)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    for _ in range(2):
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()


def _inflight() -> None:
    GROUPS.extend(dist.new_group([0, 1]) for _ in range(2))
    for group in GROUPS:
        for _ in range(20):  # never waited: the gloo workers finish and drop them while the process ends
            dist.all_reduce(torch.ones(256), group=group, async_op=True)


def main(argv: list[str]) -> None:
    kind = argv[0]
    if "--destroy-only" in argv:
        atexit.unregister(end_process_groups)
        atexit.register(lambda: dist.destroy_process_group() if dist.is_initialized() else None)
    torch.set_num_threads(1)
    deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)
    if kind == "inflight":
        _inflight()
    else:
        with tempfile.TemporaryDirectory(prefix="ds_exit_job") as scratch:
            _train(kind, scratch)
    print(f"DONE {os.environ['RANK']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""A small 2-rank training job that injects one fault on one rank; run by ``tests/faults`` under the launcher.

``python -m deepspeed.launcher.launch ... tests/faults/_job.py WORK FAULT PHASE VICTIM``

It trains a ZeRO-1 MLP for 2 steps, saves tag ``good`` (and each rank's module state to ``WORK/good_r<R>.pt``
for the verifier), meets the other rank, and 1 s later (so the other rank is already waiting in that phase),
on step 3 (or in the next save/load), rank ``VICTIM`` hits the fault:

- ``FAULT=sigkill``, ``PHASE`` in forward | backward | step | save | load: the victim SIGKILLs itself there;
- ``FAULT=sigstop``, same phases: the victim SIGSTOPs itself (a stall; only the process-group timeout helps);
- ``PHASE=train_batch``: the same with a 2-stage pipeline (``PipelineModule``, one stage per rank) instead of the
  ZeRO-1 MLP; the victim's stage hits the fault in its forward of the third ``train_batch``.

Just before, the victim writes ``WORK/fault_at`` (``time.time()``) so the test can time the survivors' exit.
Every rank that raises writes its message to ``WORK/error_r<R>.txt`` before exiting with code 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import torch

CONFIG = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
          "zero_optimization": {"stage": 1}}


def build_engine(seed: int = 0, config: dict | None = None):
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    return deepspeed.initialize(model=model, config=config or CONFIG)[0]


PIPE_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}


def build_pipe_engine(seed: int = 0):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    deepspeed.init_distributed()  # PipelineModule splits the layers over the process group's ranks
    torch.manual_seed(seed)
    specs = [LayerSpec(torch.nn.Linear, 6, 16), LayerSpec(torch.nn.GELU), LayerSpec(torch.nn.Linear, 16, 3)]
    module = PipelineModule(specs, num_stages=2, loss_fn=torch.nn.MSELoss(), seed_layers=True)
    return deepspeed.initialize(model=module, config=PIPE_CONFIG)[0]


def train_pipe(engine, batches: int) -> None:
    """``batches`` calls of ``train_batch``; the data depend on the step number only (both stages read it)."""
    for _ in range(batches):
        gen = torch.Generator().manual_seed(1000 * engine.global_steps)
        engine.train_batch(iter([(torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen))] * 2))


def train(engine, steps: int) -> None:
    """``steps`` optimizer steps; each rank's batch depends on the step number and its rank only."""
    rank = torch.distributed.get_rank()
    for _ in range(steps):
        gen = torch.Generator().manual_seed(1000 * engine.global_steps + rank)
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
        x = x.to(engine.module[0].weight.dtype)  # fp16/bf16 modules take inputs of their dtype
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        engine.step()


class Fault:
    """Hits ``kind`` (sigkill | sigstop) on this process, once, after recording when."""

    def __init__(self, work: str, kind: str) -> None:
        self.work, self.kind, self.done = work, kind, False

    def __call__(self, *_args, **_kwargs) -> None:
        if self.done:
            return
        self.done = True
        with open(os.path.join(self.work, "fault_at"), "w", encoding="utf-8") as handle:
            handle.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if self.kind == "sigkill" else signal.SIGSTOP)


def arm(engine, phase: str, fault: Fault) -> None:
    """Make ``fault`` fire in ``phase`` of the next step, save or load on this rank."""
    if phase == "forward":
        engine.module[0].register_forward_hook(lambda *a: fault())
    elif phase == "backward":
        engine.module[2].weight.register_hook(lambda grad: fault())
    elif phase == "step":
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda *a: fault())
    elif phase in ("save", "load"):
        real = torch.save if phase == "save" else torch.load

        def hit(*args, **kwargs):
            fault()
            return real(*args, **kwargs)

        setattr(torch, phase, hit)
    else:
        raise ValueError(f"PHASE={phase!r}; accepted: forward, backward, step, save, load")


def start_together(work: str, timeout_s: float = 300.0) -> None:
    """Wait (through files) until every rank has imported torch and deepspeed. On a loaded machine one rank can
    start many seconds after the other, and the rendezvous waits no longer than the short process-group
    timeout these jobs use."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    open(os.path.join(work, f"ready_r{rank}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(work, f"ready_r{r}")) for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks did not start within {timeout_s:g} s")
        time.sleep(0.02)


def main_pipe(work: str, kind: str, victim: int) -> None:
    start_together(work)
    engine = build_pipe_engine()
    rank = torch.distributed.get_rank()
    train_pipe(engine, 2)
    engine.save_checkpoint(os.path.join(work, "ckpt"), tag="good")
    torch.save(engine.module.state_dict(), os.path.join(work, f"good_r{rank}.pt"))
    torch.distributed.barrier()
    if rank == victim:
        time.sleep(1.0)
        fault = Fault(work, kind)
        next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear)).register_forward_hook(
            lambda *a: fault())
    try:
        train_pipe(engine, 2)
    except Exception as exc:
        with open(os.path.join(work, f"error_r{rank}.txt"), "w", encoding="utf-8") as handle:
            handle.write(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        sys.exit(1)


def main(work: str, kind: str, phase: str, victim: int) -> None:
    import deepspeed  # noqa: F401 - imported before the start line, so that only set-up remains after it

    if phase == "train_batch":
        main_pipe(work, kind, victim)
        return
    start_together(work)
    engine = build_engine()
    rank = torch.distributed.get_rank()
    train(engine, 2)
    engine.save_checkpoint(os.path.join(work, "ckpt"), tag="good")
    torch.save(engine.module.state_dict(), os.path.join(work, f"good_r{rank}.pt"))
    torch.distributed.barrier()
    if rank == victim:  # let the other rank finish the save's last store calls and wait in the faulty phase
        time.sleep(1.0)
        arm(engine, phase, Fault(work, kind))
    try:
        if phase == "save":
            train(engine, 1)
            engine.save_checkpoint(os.path.join(work, "ckpt"), tag="next")
        elif phase == "load":
            engine.load_checkpoint(os.path.join(work, "ckpt"))
        else:
            train(engine, 1)
        train(engine, 1)  # a survivor of a fault in a save/load must not get further than this either
    except Exception as exc:
        with open(os.path.join(work, f"error_r{rank}.txt"), "w", encoding="utf-8") as handle:
            handle.write(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        sys.exit(1)
    with open(os.path.join(work, f"finished_r{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump({"steps": engine.global_steps}, handle)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], args[1], args[2], int(args[3]))

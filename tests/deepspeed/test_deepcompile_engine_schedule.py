"""``engine.compile(schedule=...)`` resolves DeepCompile's own pass names (``zero3_compile``, ``prefetch``, ...) and
checks their contracts; the default ZeRO-3 schedule is DeepSpeed's and trains on 2 ranks bitwise as
``zero3_compile`` alone."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        torch._dynamo.graph_break()  # two graphs: selective_gather plans on the last backward graph
        h = torch.tanh(self.hidden(h)) + h
        return self.out(h)


def _refused() -> str:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}, "compile": {"deepcompile": True}}
    engine, *_ = deepspeed.initialize(model=_Net(), config=config)
    try:
        engine.compile(backend="eager", schedule=[(0, ["prefetch", "zero3_compile"])])
    except Exception as exc:  # prefetch needs the gather/release nodes zero3_compile inserts before it
        return f"{type(exc).__name__}: {exc}"
    finally:
        engine.destroy()
    return "accepted"


def test_schedule_checks_the_contracts_of_named_passes():
    for message in run_distributed(_refused, world_size=1, timeout=120):
        assert "prefetch" in message and "z3_gather_release" in message


def test_builtin_pass_names_resolve_to_the_passes():
    from deepspeed.compile.backend import opt_passes, register_builtin_passes
    from deepspeed.compile.engine import _resolve_schedule
    from deepspeed.compile.passes.prefetch import schedule_prefetch
    from deepspeed.compile.passes.selective_gather import selective_gather
    from deepspeed.compile.passes.zero3_compile import add_z3_gather_release

    register_builtin_passes()
    assert {"zero3_compile", "prefetch", "selective_gather", "offload_parameters"} <= set(opt_passes)
    from deepspeed.compile.passes.offload_parameters import offload_parameter_fwd

    assert _resolve_schedule([(0, ["zero3_compile", "offload_parameters"])]) == [(0, [add_z3_gather_release,
                                                                                     offload_parameter_fwd])]
    assert _resolve_schedule([(0, ["zero3_compile"]), (2, ["zero3_compile", schedule_prefetch, "selective_gather"])]) \
        == [(0, [add_z3_gather_release]), (2, [add_z3_gather_release, schedule_prefetch, selective_gather])]


def test_default_schedule_is_deepspeeds():
    from types import SimpleNamespace

    from deepspeed.compile.init_z3 import WARMUP, default_schedule
    from deepspeed.compile.passes.offload_parameters import offload_parameter_fwd
    from deepspeed.compile.passes.prefetch import schedule_prefetch
    from deepspeed.compile.passes.selective_gather import selective_gather
    from deepspeed.compile.passes.zero3_compile import add_z3_gather_release

    plain = SimpleNamespace(offload_parameters=False, offload_opt_states=False, offload_activation=False)
    assert WARMUP == 5
    assert default_schedule(plain) == [(0, [add_z3_gather_release]),
                                       (5, [add_z3_gather_release, schedule_prefetch, selective_gather])]
    params = SimpleNamespace(offload_parameters=True, offload_opt_states=False, offload_activation=False)
    assert default_schedule(params) == [(0, [add_z3_gather_release, offload_parameter_fwd])]


def _train(default_schedule: bool, steps: int) -> tuple[bytes, bytes, int]:
    """One rank's losses and final weight partitions (bytes) and how many parameters selective_gather kept."""
    import random
    import time

    import torch.distributed as dist

    import deepspeed
    from deepspeed.compile.util import get_deepcompile_handle

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}, "compile": {"deepcompile": True}}
    engine, *_ = deepspeed.initialize(model=_Net(), config=config)
    engine.compile(backend="eager", schedule=None if default_schedule else [(0, ["zero3_compile"])])
    data, pause = torch.Generator().manual_seed(1 + dist.get_rank()), random.Random()
    losses = []
    try:
        for _ in range(steps):
            time.sleep(pause.uniform(0.0, 0.01))  # jittered timing between the ranks
            loss = engine(torch.randn(2, 8, generator=data)).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
        persistent = sum(1 for p in get_deepcompile_handle().params.values() if p.persistent)
        weights = b"".join(p.ds_tensor.detach().contiguous().numpy().tobytes() for p in engine.module.parameters())
    finally:
        engine.destroy()
    return torch.stack(losses).numpy().tobytes(), weights, persistent


@pytest.mark.slow  # compiles 3 x 2 ranks (about a minute on 2 cores)
def test_default_schedule_on_two_ranks_is_bitwise_zero3_compile_alone():
    """DeepSpeed's default schedule switches prefetch and selective_gather on at step 5 (every graph recompiled and
    profiled on both ranks): twice, it finishes and trains bitwise as zero3_compile alone (prefetch only moves the
    all-gathers; persistent parameters are regathered after each optimizer step). The full 10-run check is
    benchmarks/deepcompile_prefetch_repeat.py."""
    steps = 7
    baseline = run_distributed(_train, world_size=2, args=(False, steps), timeout=240)
    for _ in range(2):
        ranks = run_distributed(_train, world_size=2, args=(True, steps), timeout=240)
        for (losses, weights, persistent), (base_losses, base_weights, base_persistent) in zip(ranks, baseline,
                                                                                              strict=True):
            assert losses == base_losses and weights == base_weights
            assert base_persistent == 0 and persistent > 0  # the planning passes did run

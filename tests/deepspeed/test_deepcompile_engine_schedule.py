"""``engine.compile(schedule=...)`` resolves DeepCompile's own pass names (``zero3_compile``, ``prefetch``, ...) and
checks their contracts."""

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
    from deepspeed.compile.passes.zero3_compile import add_z3_gather_release

    register_builtin_passes()
    assert {"zero3_compile", "prefetch", "selective_gather", "offload_parameters"} <= set(opt_passes)
    from deepspeed.compile.passes.offload_parameters import offload_parameter_fwd

    assert _resolve_schedule([(0, ["zero3_compile", "offload_parameters"])]) == [(0, [add_z3_gather_release,
                                                                                     offload_parameter_fwd])]
    # resolved, then refused on the engine path: their multi-rank profiling stalled over gloo
    with pytest.raises(ValueError, match=r"step 2 names \['prefetch'\]"):
        _resolve_schedule([(0, ["zero3_compile"]), (2, ["zero3_compile", schedule_prefetch])])

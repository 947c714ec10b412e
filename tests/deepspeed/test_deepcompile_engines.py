"""Several DeepCompile engines in one process: each owns its schedule, graphs, profiles and runtime handle
(``deepspeed.compile.state``), so destroying one leaves another working, and the harness's reused worker
processes (ranks with different histories of earlier engines) run a 2-rank DeepCompile training bitwise."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed

_CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3}, "compile": {"deepcompile": True}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _engine(schedule=None):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=_model(), config=_CONFIG)
    engine.compile(backend="eager", schedule=schedule)
    return engine


def _steps(engine, n: int, seed: int) -> list[float]:
    data = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        loss = engine(torch.randn(2, 8, generator=data)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine) -> bytes:
    return b"".join(p.ds_tensor.detach().contiguous().numpy().tobytes() for p in engine.module.parameters())


def _two_engines_one_destroyed() -> dict:
    from deepspeed.compile import backend
    from deepspeed.compile.state import active_state

    first = _engine()
    _steps(first, 1, seed=1)
    second = _engine()
    _steps(second, 1, seed=1)
    out = {"separate": first._deepcompile_state is not second._deepcompile_state,
           "handles": first._deepcompile_state.handle is not second._deepcompile_state.handle,
           "view_is_active": backend.profiling_results is second._deepcompile_state.profiling_results}
    first.destroy()  # releases the first engine's state only
    out["second_params_kept"] = len(second._deepcompile_state.handle.params) == 4
    out["second_trains"] = _steps(second, 2, seed=2)
    reference = _engine()  # the same model and data on a fresh engine, after the others' history
    _steps(reference, 1, seed=1)
    out["reference"] = _steps(reference, 2, seed=2)
    out["same_weights"] = _weights(second) == _weights(reference)
    states = [e._deepcompile_state for e in (second, reference)]
    second.destroy()
    reference.destroy()
    # the active state is none of the destroyed engines' (the detached default), and theirs were emptied
    out["default_after"] = (all(active_state() is not s for s in states)
                            and all(not s.handle.params and s.remaining_schedule is None for s in states))
    return out


def test_engines_own_their_state_and_destroy_only_theirs():
    (out, ) = run_distributed(_two_engines_one_destroyed, world_size=1, timeout=240)
    assert out["separate"] and out["handles"] and out["view_is_active"]
    assert out["second_params_kept"]
    assert out["second_trains"] == out["reference"] and out["same_weights"]
    assert out["default_after"]


def _leave_an_engine_behind(schedule) -> int:
    engine = _engine(schedule)  # never destroyed: its state stays with it in this worker process
    _steps(engine, 2, seed=3)
    return len(engine._deepcompile_state.opt_pass_times)


def _bitwise_pair() -> tuple[list[float], bytes, list[float], bytes]:
    import torch.distributed as dist

    seed = 10 + dist.get_rank()
    plain = _engine([(0, ["zero3_compile"])])
    plain_losses = _steps(plain, 3, seed)
    plain_weights = _weights(plain)
    plain.destroy()
    again = _engine()
    again_losses = _steps(again, 3, seed)
    again_weights = _weights(again)
    again.destroy()
    return plain_losses, plain_weights, again_losses, again_weights


@pytest.mark.slow  # compiles 3 x 2 ranks (about a minute on 2 cores)
def test_engines_in_reused_workers_then_two_rank_bitwise():
    # one worker gets a history of DeepCompile engines (one left alive), the other does not
    assert run_distributed(_leave_an_engine_behind, world_size=1, args=([(0, ["zero3_compile"])], ),
                           timeout=240)[0] > 0
    assert run_distributed(_leave_an_engine_behind, world_size=1, args=(None, ), timeout=240)[0] > 0
    for plain_losses, plain_weights, losses, weights in run_distributed(_bitwise_pair, world_size=2, timeout=300):
        assert losses == plain_losses and weights == plain_weights


def _python_dispatcher_on() -> bool:
    return "PythonDispatcher" in str(torch._C._dispatch_tls_local_include_set())


def test_passes_and_their_collectives_run_outside_the_python_dispatcher():
    # AOT autograd compiles with the Python dispatcher on; a gloo collective enqueued under it holds the GIL
    # while gloo's worker may need it (the stall of prefetch + selective_gather on 2 ranks; compile.comm_guard)
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx import symbolic_trace

    from deepspeed.compile.backend import run_opt_passes
    from deepspeed.compile.comm_guard import outside_python_dispatcher

    seen = []

    def probe(gm, *args):
        seen.append(_python_dispatcher_on())

    gm = symbolic_trace(torch.nn.Linear(2, 2))
    with enable_python_dispatcher():
        assert _python_dispatcher_on()
        with outside_python_dispatcher():
            seen.append(_python_dispatcher_on())
        run_opt_passes([probe, probe], gm, 0, [], {}, lambda: (torch.ones(2), ), 0.0, {}, False)
        assert _python_dispatcher_on()  # back on after
    assert seen == [False, False, False]


def _two_offload_engines() -> str:
    import deepspeed

    config = {**_CONFIG, "compile": {"deepcompile": True, "offload_opt_states": True}}
    first, *_ = deepspeed.initialize(model=_model(), config=config)
    first.compile(backend="eager")
    second, *_ = deepspeed.initialize(model=_model(), config=config)
    second.compile(backend="eager")  # rebinds the (process-wide) optimizer-state offload to its optimizer
    try:
        first(torch.ones(2, 8))
    except RuntimeError as exc:
        return str(exc)
    finally:
        first.destroy()
        second.destroy()
    return "ran"


def test_an_engine_whose_optimizer_state_offload_was_rebound_refuses_to_run():
    (message, ) = run_distributed(_two_offload_engines, world_size=1, timeout=120)
    assert "offload_opt_states is bound to another engine's optimizer" in message

"""Engine setup for DeepCompile over ZeRO stages 1 and 2 (``init_z1_and_2``).

Parameters stay whole, so the graphs need no gathers; gradients stay with autograd, whose accumulation fires the
engine's per-parameter hooks (precision bookkeeping, then the bucketed reduction of stages 1/2) once per parameter
and backward, also for a parameter several graphs read (a graph break), exactly as in eager training. DeepSpeed
moves that reduction into the graph (``reduce_grad`` per gradient); taking a gradient out of the graph per graph
would reduce a shared parameter before all its contributions arrived, so the default schedule runs no pass, and
a user schedule can still add passes (e.g. profiling or activation offload).
"""

from __future__ import annotations

from typing import Any


def init_z1_and_2(engine: Any, backend: Any, compile_config: Any, compile_kwargs: dict,
                  schedule: list | None = None, use_z2: bool = False) -> Any:
    """Number the parameters (``param_id``, what the backend keys non-ZeRO-3 parameters by) and return
    DeepCompile's Dynamo backend."""
    from deepspeed.compile.backend import init_schedule, make_backend
    from deepspeed.compile.state import attach_engine_state

    state = attach_engine_state(engine)
    state.handle.init(engine.seq_dp_group, compile_config)
    for i, param in enumerate(engine.module.parameters()):
        param.param_id = i
    engine._deepcompile_active = True
    init_schedule(schedule if schedule is not None else [(0, [])], state)
    return make_backend(backend, compile_config, compile_kwargs, owned_frames=state.owned_frames, state=state)

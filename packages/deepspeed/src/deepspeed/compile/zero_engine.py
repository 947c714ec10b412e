"""``engine.compile()`` with ``compile.deepcompile`` over ZeRO: the module's call runs the graphs DeepCompile's
backend (``backend.make_backend``) rewrote, behind a thin call that advances the pass schedule at the engine's
global step (``launch_compile_passes``) and keeps the ZeRO-3 eager fallback around each forward."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.utils import log_dist
from ds_config import ConfigError, ConfigProblem


class DeepCompileCall:
    """``module._compiled_call_impl`` under DeepCompile."""

    def __init__(self, compiled: Any, engine: Any) -> None:
        self.compiled = compiled
        self.engine_ref = engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from deepspeed.compile.backend import launch_compile_passes
        from deepspeed.compile.init_offload import check_offload_binding
        from deepspeed.compile.state import activate
        from deepspeed.compile.z3_eager_fallback import deepcompile_z3_forward_context

        engine = self.engine_ref
        state = engine._deepcompile_state
        activate(state)  # this engine's forward (and the backward after it) use its state
        check_offload_binding(state.offload_opt_states_optimizer)
        launch_compile_passes(engine.global_steps, owned_frames=state.owned_frames, state=state)
        handle = state.handle
        handle.clear_all_gathered_params()  # an optimizer step since the last forward changed the partitions
        handle.start_forward()
        with deepcompile_z3_forward_context(engine):
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as exc:  # DeepCompile's own error, unwrapped
                raise exc.inner_exception from exc


def compile_zero(engine: Any, backend: Any, kwargs: dict[str, Any], schedule: Any) -> None:
    """Compile ``engine.module`` with DeepCompile's ZeRO passes (stage 0: plain ``torch.compile``)."""
    import weakref

    from deepspeed.compile.init_z1_and_2 import init_z1_and_2
    from deepspeed.compile.init_z3 import init_z3

    stage = engine.zero_optimization_stage()
    if stage == 0:  # as DeepSpeed: nothing for DeepCompile to do, plain torch.compile
        log_dist("DeepCompile supports ZeRO stages 1-3; with stage 0 the module is compiled with torch.compile",
                 ranks=[0])
        engine.module.compile(backend=backend, **kwargs)
        return
    if stage not in (1, 2, 3):
        raise ConfigError(ConfigProblem("zero_optimization.stage", "DeepCompile's ZeRO passes need ZeRO stage 1, 2 "
                                        "or 3", stage))
    if backend not in ("eager", "inductor"):
        raise ValueError(f"engine.compile: DeepCompile supports the backends 'eager' and 'inductor', got {backend!r}")
    if stage == 3:
        dc_backend = init_z3(engine, backend, engine._config.compile, kwargs, schedule)
    else:
        dc_backend = init_z1_and_2(engine, backend, engine._config.compile, kwargs, schedule, use_z2=stage == 2)
    module = engine.module
    try:
        # a frame of this file (Dynamo skips torch.nn's own frames, so a model made only of torch.nn modules
        # would never be captured from its _call_impl)
        compiled = torch.compile(_entry(module), backend=dc_backend, **{"dynamic": False, **kwargs})
    except BaseException:
        engine._set_deepcompile_active(False)
        raise
    module._compiled_call_impl = DeepCompileCall(compiled, weakref.proxy(engine))


def _entry(module: torch.nn.Module) -> Any:
    def run_module(*args: Any, **kwargs: Any) -> Any:
        return module._call_impl(*args, **kwargs)

    return run_module

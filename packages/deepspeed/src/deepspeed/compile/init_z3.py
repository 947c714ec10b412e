"""Engine setup for DeepCompile over ZeRO-3 (``init_z3``) and the Dynamo settings it needs.

A ZeRO-3 parameter's ``data`` is empty while released and whole while gathered, so Dynamo must not specialize
on parameter shapes (``force_parameter_static_shapes`` / ``force_nn_module_property_static_shapes`` off while
a DeepCompile ZeRO-3 engine lives). Those settings are process-wide: every engine holds a claim and the values
before the first claim come back when the last claim is released, in whatever order engines go.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

_MISSING = object()
_DYNAMO_SETTINGS = ("force_parameter_static_shapes", "force_nn_module_property_static_shapes")
_claims: dict[int, dict[str, Any]] = {}  # id(dynamo config) -> {"config", "saved", "owners"}
_claims_lock = threading.Lock()


def _dynamo_config() -> Any:
    dynamo = getattr(torch, "_dynamo", None)
    if dynamo is None:
        try:
            import torch._dynamo as dynamo
        except ImportError:
            return None
    return getattr(dynamo, "config", None)


def _allow_dynamo_dynamic_parameter_shapes_for_z3(compile_kwargs: dict) -> Callable[[], None] | None:
    """Turn Dynamo's static parameter shapes off for one owner; returns the owner's release callback (None when
    this torch has neither setting)."""
    config = _dynamo_config()
    if config is None:
        return None
    token, key = object(), id(config)
    with _claims_lock:
        claim = _claims.get(key)
        if claim is None or claim["config"] is not config:
            saved = {name: getattr(config, name) for name in _DYNAMO_SETTINGS if hasattr(config, name)}
            if not saved:
                return None
            claim = _claims[key] = {"config": config, "saved": saved, "owners": set()}
        claim["owners"].add(token)
        for name in claim["saved"]:
            setattr(config, name, False)

    def release() -> None:
        with _claims_lock:
            current = _claims.get(key)
            if current is None or current["config"] is not config or token not in current["owners"]:
                return  # released already (idempotent)
            current["owners"].discard(token)
            if current["owners"]:
                return
            for name, value in current["saved"].items():
                setattr(config, name, value)
            del _claims[key]

    return release


def _resolve_expected_grad_dtype(param: Any) -> torch.dtype | None:
    """The dtype a gradient of ``param`` must have, as autograd's leaf accumulation decides it: the parameter's
    ``grad_dtype`` when set (None: any dtype is accepted), else the parameter's dtype."""
    grad_dtype = getattr(param, "grad_dtype", _MISSING)
    return param.dtype if grad_dtype is _MISSING else grad_dtype


def _hand_to_reducer(engine: Any, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """The engine's ZeRO-3 reduce-scatter takes a whole gradient from ``param.grad``; a released parameter cannot
    hold one (autograd checks the shape), so it briefly wears a zero-stride whole-shaped view of one element."""
    if not engine._in_backward:
        engine._begin_backward()
    if not engine._syncing:
        return
    released = param.data
    with torch.no_grad():
        param.data = torch.zeros((), dtype=param.dtype, device=grad.device).expand(param.ds_shape)
        try:
            param.grad = grad.to(param.dtype)
            engine.reducer.grad_ready(param)
        finally:
            param.grad = None
            param.data = released


def _undo_eager_linear(engine: Any) -> None:
    """ZeRO-3's memory-efficient linear (an autograd function gathering weights itself) is left out of the graph."""
    from ds_zero.zero3.linear import remove_functional_linear

    for module in engine.module.modules():
        if isinstance(module, torch.nn.Linear) and "forward" in module.__dict__:
            del module.__dict__["forward"]
    remove_functional_linear(engine.zero3_scheduler)


WARMUP = 5  # steps run with zero3_compile alone before the planning passes take over (DeepSpeed's)


def default_schedule(compile_config: Any) -> list:
    """DeepSpeed's default ZeRO-3 schedule: ``zero3_compile`` from step 0 and ``zero3_compile`` + ``prefetch`` +
    ``selective_gather`` from step ``WARMUP``; with ``offload_parameters``, ``zero3_compile`` +
    ``offload_parameters`` from step 0; an optimizer-state or activation offload target brings its own
    (``init_offload.offload_schedule``). Each step rewrites the captured graphs from scratch, so every entry
    lists all its passes."""
    from deepspeed.compile.init_offload import offload_schedule
    from deepspeed.compile.passes import offload_parameters, prefetch, selective_gather
    from deepspeed.compile.passes.zero3_compile import add_z3_gather_release

    if getattr(compile_config, "offload_parameters", False):
        return [(0, [add_z3_gather_release, offload_parameters.offload_parameter_fwd])]
    offload = offload_schedule(compile_config, add_z3_gather_release, warmup=WARMUP)
    if offload is not None:
        return offload
    return [(0, [add_z3_gather_release]),
            (WARMUP, [add_z3_gather_release, prefetch.schedule_prefetch, selective_gather.selective_gather])]


def init_z3(engine: Any, backend: Any, compile_config: Any, compile_kwargs: dict, schedule: list | None = None
            ) -> Any:
    """Hand the engine's ZeRO-3 parameters to DeepCompile and return its Dynamo backend.

    The module hooks come off (compiled graphs gather and release), every parameter goes back to its partition
    and is registered with the runtime (none persistent), whole gradients from the backward graphs go to the
    engine's reduce-scatter, and the schedule defaults to DeepSpeed's (``default_schedule``).
    """
    from deepspeed.compile.backend import init_schedule, make_backend
    from deepspeed.compile.init_offload import bind_offload_passes, check_offload_targets
    from deepspeed.compile.patch_fake_tensor import patch_fake_tensor
    from deepspeed.compile.state import attach_engine_state
    from deepspeed.compile.z3_eager_fallback import DeepCompileZ3EagerFallback

    check_offload_targets(engine, compile_config)  # before anything below converts the engine
    scheduler = engine.zero3_scheduler
    engine._set_deepcompile_active(True)  # the hooks off, gathered parameters released
    scheduler.release_all(include_persistent=True)
    scheduler.persistent = []  # nothing is regathered after a step: the graphs gather what they read
    _undo_eager_linear(engine)
    state = attach_engine_state(engine)  # this engine's schedule, graphs, profiles and handle
    handle = state.handle
    handle.init(engine.seq_dp_group, compile_config)
    for param in engine.module.parameters():
        if hasattr(param, "ds_id"):
            if type(param).__name__ == "PartitionedParameter":
                # ZeRO-3's guard class refuses computation on a released parameter from __torch_function__;
                # compiled graphs gather it themselves, and Dynamo must see a plain Parameter
                param.__class__ = torch.nn.Parameter
            param.ds_persist = False
            handle.register_z3_param(param, grad_dtype=_resolve_expected_grad_dtype(param))
    handle.set_grad_sink(lambda param, grad: _hand_to_reducer(engine, param, grad))
    engine._deepcompile_z3_eager_fallback = DeepCompileZ3EagerFallback(engine)
    if schedule is None:
        schedule = default_schedule(compile_config)
    init_schedule(schedule, state)
    if bind_offload_passes(schedule, engine.optimizer, handle):
        state.offload_opt_states_optimizer = engine.optimizer
    patch_fake_tensor()
    engine._release_deepcompile_dynamo_config()
    restore = _allow_dynamo_dynamic_parameter_shapes_for_z3(compile_kwargs)
    if restore is not None:
        engine._deepcompile_dynamo_config_restore = restore
    return make_backend(backend, compile_config, compile_kwargs, owned_frames=state.owned_frames, state=state)

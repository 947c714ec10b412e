"""DeepCompile's offload targets over ZeRO-3 (``compile.offload_opt_states``, ``compile.offload_activation``): the
checks ``init_z3`` runs before it touches the engine, the default schedule entries, and binding the optimizer-state
pass to the optimizer it moves.

A run has one offload target: each pass plans against the whole memory budget on its own, so two of them together
would move far more than needed; and ZeRO's own ``offload_optimizer`` (cpu/nvme) already owns the optimizer state
for the whole step, which ``offload_opt_states`` would move around the graph as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .passes import offload_activation, offload_adam_states


def check_offload_targets(engine: Any, compile_config: Any) -> None:
    """Refuse conflicting offload settings (ValueError naming them) before anything is converted."""
    opt_states = getattr(compile_config, "offload_opt_states", False)
    activations = getattr(compile_config, "offload_activation", False)
    parameters = getattr(compile_config, "offload_parameters", False)
    # zero_use_cpu_optimizer: an offload_optimizer section with device none is present but inert
    if opt_states and engine.zero_use_cpu_optimizer():
        raise ValueError("compile.offload_opt_states cannot be combined with zero_optimization.offload_optimizer "
                         "on cpu or nvme: ZeRO then keeps the optimizer state off the accelerator for the whole step "
                         "while this pass moves it around the compiled graph; enable one of them")
    if activations and (parameters or opt_states):
        other = "offload_parameters" if parameters else "offload_opt_states"
        raise ValueError(f"compile.offload_activation cannot be combined with compile.{other}: one offload target "
                         "per run (each plans against the whole memory budget)")
    if parameters and opt_states:
        raise ValueError("compile.offload_parameters and compile.offload_opt_states cannot both be on (one offload "
                         "target per run; offload_parameters is also turned on by a ZeRO config offloading both "
                         "the optimizer and the parameters to cpu)")


def offload_schedule(compile_config: Any, z3_pass: Callable, warmup: int) -> list | None:
    """The default schedule for the configured optimizer-state or activation offload; None when neither is on.

    Optimizer states exist from step 0's optimizer step, so their offload engages at step 1, planned against the
    floor ``offload_adam_states_for_init`` measures. The activation floor engages at step 0 (a run that only fits
    with its activations out never reaches a later step otherwise) and the planner at ``warmup``. Each step
    rewrites the captured graph from scratch, so every entry lists all its passes.
    """
    if getattr(compile_config, "offload_opt_states", False):
        return [(0, [z3_pass]),
                (1, [offload_adam_states.offload_adam_states_for_init, z3_pass, offload_adam_states.move_opt_states])]
    if getattr(compile_config, "offload_activation", False):
        offload_activation.register_activation_offload_ops()
        floor = offload_activation.offload_activation_floor
        return [(0, [z3_pass, floor]), (warmup, [z3_pass, floor, offload_activation.offload_activation])]
    return None


_OPT_STATE_PASSES = (offload_adam_states.move_opt_states, offload_adam_states.move_opt_states_sync,
                     offload_adam_states.offload_adam_states_for_init)


def bind_offload_passes(schedule: list, optimizer: Any, handle: Any) -> bool:
    """Point the optimizer-state pass at ``optimizer`` when the schedule uses it (True then). That binding is
    process-wide: the engine checks at each forward that it is still its own (``check_offload_binding``)."""
    if any(p in _OPT_STATE_PASSES for _, passes in schedule for p in passes):
        offload_adam_states.init_offload_opt_states(optimizer, handle)
        return True
    return False


def check_offload_binding(bound_optimizer: Any) -> None:
    """Refuse a forward of an engine whose optimizer-state offload was rebound to another engine's optimizer
    (its graphs would move that engine's states)."""
    if bound_optimizer is not None and offload_adam_states.optimizer is not bound_optimizer:
        raise RuntimeError("DeepCompile: compile.offload_opt_states is bound to another engine's optimizer (an engine "
                           "compiled with it after this one); one engine with offload_opt_states per process at a "
                           "time: destroy() the other engine or compile without offload_opt_states")

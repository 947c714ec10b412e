"""``DeepSpeedEngine.compile``: plain ``torch.compile`` of the wrapped module, or DeepCompile's AutoSP pass.

AutoSP (``compile: {deepcompile: true, passes: ["autosp"]}`` with ``sequence_parallel_size: P``) compiles the
module's call with a backend that runs AutoSP's graph passes (``passes.sp_compile.apply_autosp``: the whole
sequence enters the graph, the graph keeps this rank's shard of the inputs ``prepare_autosp_inputs`` marked and
puts all-to-alls around attention) and then AutoSP's memory optimization (``passes.long_context_checkpointing``:
selective activation checkpointing) before the requested backend. Each rank's loss is then the loss of its shard
(e.g. a mean over its tokens), so gradients are averaged over the
sequence-data-parallel ranks (DeepSpeed's AutoSP treats the sequence ranks like data-parallel ones for the
reduction), unlike hand-written Ulysses where each rank's loss is its share of the whole and sequence ranks sum.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from deepspeed.utils import log_dist
from ds_config import ConfigError, ConfigProblem


def compile_engine(engine: Any, backend: Any, compile_kwargs: dict[str, Any], schedule: Any,
                   compiled_autograd_enabled: bool) -> None:
    """Compile ``engine.module`` in place (see ``DeepSpeedEngine.compile``)."""
    section = engine._config.compile
    if schedule is not None and not (section.deepcompile and not section.autosp):
        raise ValueError("engine.compile: schedule orders DeepCompile's ZeRO passes (compile.deepcompile without "
                         "AutoSP); pass schedule=None")
    if compiled_autograd_enabled:
        raise ValueError("engine.compile: compiled_autograd_enabled=True (a compiled backward) is not available in "
                         "this version: the engine reduces gradients from hooks in eager autograd; pass False")
    if not isinstance(compile_kwargs, dict):
        raise TypeError(f"engine.compile: compile_kwargs must be a dict, got {type(compile_kwargs).__name__}")
    kwargs = {**section.kwargs, **compile_kwargs}
    if "backend" in kwargs:
        log_dist("engine.compile: 'backend' in compile_kwargs is overridden by the backend argument", ranks=[0],
                 level=logging.WARNING)
        del kwargs["backend"]
    if engine.is_compiled:
        log_dist("engine.compile: the module is already compiled; nothing to do", ranks=[0])
        return
    backend = section.backend if backend is None else backend  # None: the compile section's backend
    if not section.deepcompile:
        engine.module.compile(backend=backend, **kwargs)
        return
    if "autotp" in (section.passes or []):  # AutoTP's pass (deepspeed.compile.init_tp)
        from deepspeed.compile.init_tp import compile_autotp

        compile_autotp(engine, backend, kwargs)
        return
    check_deepcompile(section)
    if not section.autosp:  # DeepCompile's ZeRO passes (deepspeed.compile.zero_engine)
        from deepspeed.compile.zero_engine import compile_zero

        compile_zero(engine, backend, kwargs, _resolve_schedule(schedule))
        return
    compile_autosp(engine, backend, kwargs)


def _resolve_schedule(schedule: Any) -> Any:
    """A user schedule's pass names become the registered passes, after checking their contracts."""
    if schedule is None:
        return None
    from deepspeed.compile.backend import opt_passes, register_builtin_passes
    from deepspeed.compile.passes.contract import validate_schedule

    register_builtin_passes()  # DeepCompile's own passes may be named: "zero3_compile", "prefetch", ...
    validate_schedule(schedule, opt_passes)
    resolved = []
    for step, passes in schedule:
        unknown = [p for p in passes if not callable(p) and p not in opt_passes]
        if unknown:
            raise ValueError(f"engine.compile: schedule step {step} names unknown passes {unknown}; registered: "
                             f"{sorted(opt_passes)}")
        resolved.append((step, [p if callable(p) else opt_passes[p] for p in passes]))
    return resolved


def check_deepcompile(section: Any) -> None:
    """``compile`` with ``deepcompile``: AutoTP, AutoSP (alone), or the ZeRO passes (``passes`` unset, or ``z1`` /
    ``z3``), as DeepSpeed routes them."""
    passes = section.passes or []
    if "autotp" in passes:  # what AutoTP's pass may be combined with is checked by engine.compile
        return
    if section.autosp and any(p != "autosp" for p in passes):
        raise ConfigError(ConfigProblem("compile.passes", "AutoSP cannot yet be combined with DeepCompile's other "
                                        "passes; accepted: [\"autosp\"], or ZeRO passes without it", passes))


class _AutoSPCall:
    """The module's call under AutoSP: check the marked inputs, run the compiled graph, explain graph breaks."""

    def __init__(self, compiled: Any, world: int) -> None:
        self.compiled, self.world = compiled, world

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from deepspeed.compile.passes.sp_compile import check_inputs

        if self.world == 1:
            return self.compiled(*args, **kwargs)
        check_inputs((args, kwargs), self.world)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:  # the AutoSP pass's own error, unwrapped
            raise exc.inner_exception from exc
        except torch._dynamo.exc.Unsupported as exc:
            raise RuntimeError("AutoSP needs the model's forward as one graph, but torch.compile found a graph break "
                               "(AutoSP cannot follow the sequence sharding across separate graphs); remove the "
                               f"construct torch.compile reports: {str(exc).splitlines()[0]}") from exc


def compile_autosp(engine: Any, backend: Any, kwargs: dict[str, Any]) -> None:
    """Compile ``engine.module`` with the AutoSP pass over the engine's sequence-parallel group."""
    from deepspeed.compile.passes import long_context_checkpointing
    from deepspeed.compile.passes.sp_compile import apply_autosp
    from deepspeed.utils import groups

    if engine.zero_optimization_stage() not in (0, 1):
        raise ConfigError(ConfigProblem("zero_optimization.stage", "AutoSP trains with ZeRO stage 0 or 1; "
                                        "accepted: 0, 1", engine.zero_optimization_stage()))
    if kwargs.get("fullgraph", True) is not True:
        raise ValueError("engine.compile: AutoSP compiles the whole forward as one graph; drop fullgraph=False from "
                         "compile_kwargs")
    world = engine.sequence_parallel_size
    if world > 1:  # the graph pass's mesh: groups of consecutive ranks, as the engine's sequence groups
        group, rank = groups._get_sequence_parallel_group(), torch.distributed.get_rank()
        if torch.distributed.get_rank(group) != rank % world:
            raise RuntimeError(f"AutoSP needs sequence-parallel groups of consecutive ranks; rank {rank} is rank "
                               f"{torch.distributed.get_rank(group)} of its group, not {rank % world}")
    data = torch.distributed.get_world_size() // world if world > 1 else 1
    if world > 1:  # now, on every rank together: creating the groups is collective
        from deepspeed.compile.custom_ops import sp_dp_registry

        sp_dp_registry.populate_registry(world, data)
    inner = backend if callable(backend) else torch._dynamo.lookup_backend(backend)

    checkpointing = long_context_checkpointing.enabled

    def autosp_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        if world > 1:
            apply_autosp(gm, example_inputs, sp_size=world, dp_size=data)
        if checkpointing:  # AutoSP's memory optimization: recompute matmuls, keep attention
            gm = long_context_checkpointing.selective_checkpoint(gm)
        return inner(gm, example_inputs)

    module = engine.module
    compiled = torch.compile(module._call_impl, backend=autosp_backend, **{**kwargs, "fullgraph": True})
    module._compiled_call_impl = _AutoSPCall(compiled, world)  # what nn.Module.compile sets
    _average_over_sequence_ranks(engine)


def _average_over_sequence_ranks(engine: Any) -> None:
    """Gradients of AutoSP ranks (each a loss over its own shard) are averaged over the sequence-data group."""
    from deepspeed.runtime.grad_reduce import BucketedAllReduce

    if engine.sequence_parallel_size == 1 or engine.reducer is None:
        return
    if engine.zero_optimization_stage() == 1:  # ZeRO-1 divides by the sequence-data size from the start
        return  # (runtime.engine._zero: an AutoSP config's ZeRO reduction averages over the sequence ranks)
    if not isinstance(engine.reducer, BucketedAllReduce):
        raise ConfigError(ConfigProblem("compile.passes", "AutoSP trains with the engine's data-parallel all-reduce "
                                        f"(not {type(engine.reducer).__name__}: 1-bit optimizers and MoE layers are "
                                        "not supported with it)", ["autosp"]))
    engine.reducer.options = dataclasses.replace(engine.reducer.options, world_size=engine.seq_dp_world_size)

"""DeepCompile under the ``inductor`` backend: Inductor builds its AOT autograd backend itself, so DeepCompile
wraps the compilers and partitioner that ``AotAutograd`` is constructed with (``patch_create_aot_dispatcher_function``,
restorable) rather than calling AOT autograd directly as it does for ``eager``.

- ``patch_compiler``: the forward/backward compiler runs DeepCompile's graph rewriting (``dc_compiler``) first; under
  ZeRO-3 the compiler then sees each parameter input as the empty tensor the released parameter really is;
- ``wrap_partition_fn``: the partitioner records that the frame has a backward (and, ZeRO-3, recomputes
  parameter aliases instead of saving them); the parameter placeholders' example values become empty tensors;
- ``register_custom_ops``: Inductor lowerings for the ``dc`` operators (and the graph-safe RNG wrapper) that run
  each as a fallback kernel and keep Inductor from reusing the buffers whose storage the runtime still holds
  (see ``_REUSE_POLICIES``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from deepspeed.compile.custom_ops import dc_ops
from deepspeed.compile.graph_param import DSGraphParamManager
from deepspeed.compile.util import get_input_nodes

if TYPE_CHECKING:
    from torch._inductor.ir import IRNode
    from torch._inductor.lowering import add_needs_realized_inputs, fallback_handler, fallbacks, register_lowering
    from torch._inductor.virtualized import V


def _empty_fake(value: Any) -> Any:
    from torch._dynamo.utils import to_fake_tensor

    return to_fake_tensor(torch.empty([0], dtype=value.dtype, device=value.device), value.fake_mode)


def patch_compiler(original_compiler: Callable, dc_compiler: Callable, z3_partition: bool, graph_id: int,
                   graph_param_manager: Any, bwd: bool) -> Callable:
    """``original_compiler`` run on the graph ``dc_compiler`` rewrote (None from ``dc_compiler``: nothing)."""

    def wrapped_compiler(gm: torch.fx.GraphModule, fake_inputs: Any) -> Any:
        if dc_compiler(gm, fake_inputs) is None:
            return None
        if not z3_partition:
            return original_compiler(gm, fake_inputs)
        manager = graph_param_manager[graph_id]
        if bwd:
            names = {n.name for n in manager.get_bwd_mapping(gm.graph)[0]}
        else:
            names = set(manager.param_names)
        inputs = tuple(_empty_fake(v) if node.name in names else v
                       for node, v in zip(get_input_nodes(gm.graph), fake_inputs, strict=False))
        return original_compiler(gm, inputs)

    return wrapped_compiler


def wrap_partition_fn(z3_partition: bool, partition_fn: Callable, real_inputs: Any, param_indices: Any,
                      frame_id: int, frames_partitioned: set[int]) -> Callable:
    """``partition_fn`` through DeepCompile's partitioner wrapper (see the module docstring)."""
    from deepspeed.compile.partitioner import get_wrapped_partitioner

    def wrapped_partition_fn(*args: Any, **kwargs: Any) -> Any:
        partition = get_wrapped_partitioner(z3_partition, param_indices, partition_fn=partition_fn,
                                            frame_id=frame_id, frames_partitioned=frames_partitioned)
        fw_module, bw_module = partition(*args, **kwargs)
        if z3_partition:
            names = set(DSGraphParamManager(fw_module.graph, real_inputs, param_indices).param_names)
            for graph in (fw_module.graph, bw_module.graph):
                for node in graph.nodes:
                    if node.op == "placeholder" and node.name in names:
                        val = node.meta["val"]
                        node.meta["val"] = torch.empty([0], dtype=val.dtype, device=val.device)
        return fw_module, bw_module

    return wrapped_partition_fn


def _patch_deepcompile_aot_kwargs(kwargs: dict, *, graph_id: int, z3_partition: bool, make_fw_graph: Callable,
                                  make_bw_graph: Callable, real_inputs: Any, param_indices: Any, param_manager: Any,
                                  frame_id: int, frames_partitioned: set[int]) -> bool:
    """Wrap the compilers and partitioner in ``AotAutograd``'s keyword arguments in place. A backend without a
    partitioner (e.g. torch_xla's ``openxla``) is left alone: returns False."""
    fw_compiler, partition_fn = kwargs.get("fw_compiler"), kwargs.get("partition_fn")
    if not fw_compiler or not partition_fn:
        return False
    bw_compiler = kwargs.get("bw_compiler") or fw_compiler
    kwargs["fw_compiler"] = patch_compiler(fw_compiler, make_fw_graph, z3_partition, graph_id, param_manager,
                                           bwd=False)
    kwargs["bw_compiler"] = patch_compiler(bw_compiler, make_bw_graph, z3_partition, graph_id, param_manager,
                                           bwd=True)
    kwargs["inference_compiler"] = kwargs["fw_compiler"]
    kwargs["partition_fn"] = wrap_partition_fn(z3_partition, partition_fn, real_inputs, param_indices, frame_id,
                                               frames_partitioned)
    return True


def patch_create_aot_dispatcher_function(graph_id: int, z3_partition: bool, make_fw_graph: Callable,
                                         make_bw_graph: Callable, real_inputs: Any, param_indices: Any,
                                         param_manager: Any, frame_id: int,
                                         frames_partitioned: set[int]) -> Callable[[], None]:
    """Make every ``AotAutograd`` constructed from now on carry this graph's DeepCompile compilers; returns the
    restore callback. A newer patch replaces an older one (which is undone first); restoring an older patch
    after a newer one was installed leaves the newer one in place."""
    from torch._dynamo.backends.common import AotAutograd

    previous = getattr(AotAutograd, "__original_init", None)
    if previous is not None:  # an older patch still installed: undo it first
        AotAutograd.__init__ = previous
        delattr(AotAutograd, "__original_init")
    original_init = AotAutograd.__init__

    @functools.wraps(original_init)
    def patched_init(self: Any, **kwargs: Any) -> None:
        _patch_deepcompile_aot_kwargs(kwargs, graph_id=graph_id, z3_partition=z3_partition,
                                      make_fw_graph=make_fw_graph, make_bw_graph=make_bw_graph,
                                      real_inputs=real_inputs, param_indices=param_indices,
                                      param_manager=param_manager, frame_id=frame_id,
                                      frames_partitioned=frames_partitioned)
        original_init(self, **kwargs)

    setattr(AotAutograd, "__original_init", original_init)
    AotAutograd.__init__ = patched_init

    def restore() -> None:
        if AotAutograd.__init__ is patched_init:
            AotAutograd.__init__ = original_init
            if getattr(AotAutograd, "__original_init", None) is original_init:
                delattr(AotAutograd, "__original_init")

    return restore


# Inductor's lowering API, imported on first use (it costs seconds, and most importers of this module never lower
# a graph with Inductor). Module attributes, so that a caller or a test may replace them.
_INDUCTOR_API = {
    "add_needs_realized_inputs": "torch._inductor.lowering",
    "fallback_handler": "torch._inductor.lowering",
    "fallbacks": "torch._inductor.lowering",
    "register_lowering": "torch._inductor.lowering",
    "IRNode": "torch._inductor.ir",
    "Scheduler": "torch._inductor.scheduler",  # served as DeepSpeed's module does; its dead-code elimination is
    # left alone here (the dc operators are marked side-effecting instead)
    "V": "torch._inductor.virtualized",
}


def _load_inductor_api() -> None:
    """Bind the names of ``_INDUCTOR_API`` that are not bound yet (a replaced one stays replaced)."""
    for name, module in _INDUCTOR_API.items():
        if name not in globals():
            globals()[name] = getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    if name in _INDUCTOR_API:
        _load_inductor_api()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class ReusePolicy:
    """Which buffers of one operator Inductor must never reuse (neither write another kernel's result into in
    place, nor hand to a later allocation). Inductor also never frees such a buffer early: it lives until the
    compiled graph returns, so a policy protects only storage that somebody besides the graph still reads.

    ``outputs``: the outputs' storage is held by the runtime (or shared with another output) after the op;
    ``inputs``: the op leaves its tensor inputs unusable or keeps reading them after it returns;
    ``unless_alias_readers``: an output read only by operators whose schema declares their result an alias of it
    is left unprotected: Inductor keeps a buffer alive as long as its declared aliases, and never writes in place
    into the alias output of a fallback kernel, so such a chain is safe and still freed at its last use."""

    outputs: bool = False
    inputs: bool = False
    unless_alias_readers: bool = False


# Why each dc operator's buffers need (or need no) protection, in this runtime (custom_ops.handle):
_REUSE_POLICIES = {
    # the gathered value stays with the handle until release_param (a persistent parameter: for good; on one rank
    # it is the partition itself): an in-place kernel writing into it corrupts the parameter. Read only through
    # wait_allgather (a declared alias), it is safe and freed when its readers are done.
    "allgather_param": ReusePolicy(outputs=True, unless_alias_readers=True),
    "wait_allgather": ReusePolicy(),  # declared alias of the gathered value (see unless_alias_readers)
    "release_param": ReusePolicy(),  # declared alias of the reader's value
    "prefetch_params_fused": ReusePolicy(),  # no tensor result; reads the partitions only
    "reduce_grad": ReusePolicy(),  # the reducer copies the gradient into its bucket before the op returns
    # the tensors it frees keep a zero-size storage: a later kernel given one of them would write out of bounds
    "free_tensors": ReusePolicy(inputs=True),
    # the host copy stays with the handle until reload_tensor; the wait returns that same storage
    "offload_tensor": ReusePolicy(outputs=True),
    "wait_offload": ReusePolicy(outputs=True),
    # the wait returns the reloaded copy's own storage under a schema that declares no alias: Inductor must
    # neither free nor recycle the copy while the wait's result is alive
    "reload_tensor": ReusePolicy(outputs=True),
    "wait_reload": ReusePolicy(outputs=True),
    "offload_parameter": ReusePolicy(),  # no tensor result
    "reload_parameter": ReusePolicy(),  # no tensor result
    "end_backward": ReusePolicy(),  # no tensor result; its inputs only order it after the reductions
}
# readers whose result is a declared alias of their first argument
_ALIAS_READERS = ("wait_allgather", "release_param")


def _get_graphsafe_run_with_rng_state() -> Any:
    """The graph-safe RNG wrapper (``torch._prims.rng_prims.graphsafe_run_with_rng_state``; None: not in this
    torch). It replays a random operator under an explicit generator state, in graphs DeepCompile rewrites."""
    try:
        from torch._prims import rng_prims
    except ImportError:
        return None
    return getattr(rng_prims, "graphsafe_run_with_rng_state", None)


def _register_graphsafe_rng_state_no_reuse(register: Callable[..., Any]) -> bool:
    """``register(op, never_reuse_output=True)`` for the graph-safe RNG wrapper: its outputs (a random result, an
    RNG state saved for the backward) are kept like the dc operators' outputs. False: no such wrapper here."""
    op = _get_graphsafe_run_with_rng_state()
    if op is None:
        return False
    register(op, never_reuse_output=True)
    return True


def _mark_output_never_reuse(out: Any, *, enabled: bool) -> Any:
    """``out`` unchanged; when ``enabled`` and ``out`` is an Inductor buffer, Inductor will never reuse it.
    Leaves that are not buffers (a SymInt, None, a Python number of a multi-output op) pass through."""
    _load_inductor_api()
    if enabled and isinstance(out, IRNode):
        V.graph.never_reuse_buffers.add(out.get_name())
    return out


def _only_alias_readers(node: torch.fx.Node | None) -> bool:
    if node is None or not node.users:
        return False
    readers = {op for name in _ALIAS_READERS if (op := _dc_op(name)) is not None}
    return all(user.target in readers and user.args and user.args[0] is node for user in node.users)


def _dc_op(name: str) -> Any:
    packet = getattr(torch.ops.dc, name, None)
    return None if packet is None else packet.default


def _no_reuse_lowering(op: Any, policy: ReusePolicy) -> Callable[..., Any]:
    """Inductor's own fallback lowering of ``op`` (the op runs as it is, on realized inputs), then ``policy``."""
    base = fallback_handler(op, add_to_fallback_set=False)

    def lowering(*args: Any, **kwargs: Any) -> Any:
        out = base(*args, **kwargs)
        protect = policy.outputs and not (policy.unless_alias_readers and _only_alias_readers(V.graph.current_node))
        out = pytree.tree_map(lambda o: _mark_output_never_reuse(o, enabled=protect), out)
        if policy.inputs:  # realized by the fallback kernel by now
            pytree.tree_map(lambda a: _mark_output_never_reuse(a, enabled=True), (args, kwargs))
        return out

    lowering._is_fallback_handler = True  # what Inductor checks to recognise a fallback lowering
    return lowering


def _register_no_reuse(op: Any, never_reuse_output: bool = False, never_reuse_input: bool = False,
                       policy: ReusePolicy | None = None) -> None:
    policy = policy or ReusePolicy(outputs=never_reuse_output, inputs=never_reuse_input)
    fallbacks.add(op)
    add_needs_realized_inputs(op)
    register_lowering(op, type_promotion_kind=None)(_no_reuse_lowering(op, policy))


def register_custom_ops() -> None:
    """Make the ``dc`` operators safe in compiled graphs: defined, kept by dead-code elimination although several
    return nothing, and lowered for Inductor by ``_REUSE_POLICIES`` (an operator this process's ``dc`` library
    lacks, e.g. one defined elsewhere with fewer operators, is skipped); the graph-safe RNG wrapper too."""
    dc_ops.register()
    _load_inductor_api()
    for name in dc_ops.SIDE_EFFECT_OPS:
        if (op := _dc_op(name)) is not None:
            torch.fx.node.has_side_effect(op)
    for name, policy in _REUSE_POLICIES.items():
        if (op := _dc_op(name)) is not None:
            _register_no_reuse(op, policy=policy)
    _register_graphsafe_rng_state_no_reuse(_register_no_reuse)

"""DeepCompile's Dynamo backend (``make_backend``) and its pass schedule.

Each graph Dynamo captures goes through AOT autograd; when AOT autograd hands DeepCompile the forward graph (and,
later, the backward graph) the passes of the current schedule step run on it in order (``run_opt_passes``), each
followed by a memory profile of the rewritten graph run on real inputs. The schedule (``init_schedule``) is a
list of ``(global step, [passes])``; at each listed step ``launch_compile_passes`` resets Dynamo so that every
graph is captured and rewritten again, from scratch, by that step's passes (a pass's effects do not carry over).

Passes are registered by name (``register_compile_pass``) with an optional contract
(``passes.contract.PassContract``) that ``passes.contract.validate_schedule`` checks. A pass is
``fn(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget, param_manager, bwd)`` and returns
the rewritten ``GraphModule`` (or None: unchanged).

Backward graphs are compiled lazily at the first backward; ``patch_compiled_func`` captures their real inputs then.
The frames that wait for such a capture (``frames_needing_bwd``) are keyed ``(owner token, frame id)`` so two
engines never consume each other's inputs; an engine releases its own with ``cleanup_compiled_backward_state``.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, GraphModule

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.compile.comm_guard import outside_python_dispatcher
from deepspeed.compile.fx import add_free_activations
from deepspeed.compile.graph_param import DSGraphParamManager
from deepspeed.compile.inductor import patch_create_aot_dispatcher_function, register_custom_ops
from deepspeed.compile.input_storage import InputStorage
from deepspeed.compile.patch_compiled_func import (
    clear_backward_inputs,
    patch_compiled_func,
    pop_backward_input,
    register_backward_frame,
    unpatch_compiled_func,
)
from deepspeed.compile.profilers import ProfilingResult
from deepspeed.compile.state import DeepCompileState, GraphOrder, activate, active_state, register_graph
from deepspeed.compile.util import (
    get_activation_node_names,
    get_deepcompile_handle,
    get_index_by_graph_id,
    get_input_nodes,
    is_backend_inductor,
    log_rank0,
)

__all__ = ["GraphOrder", "cleanup_compiled_backward_state", "init_schedule", "launch_compile_passes", "make_backend",
           "opt_passes", "register_builtin_passes", "register_compile_pass", "run_opt_passes", "patch_compiled_func",
           "unpatch_compiled_func"]

frames_needing_bwd: set = set()  # process-wide with patch_compiled_func; keys carry their engine's token
opt_passes: dict[str, Callable] = {}  # the pass registry by name (process-wide, as DeepSpeed's)

# DeepSpeed's module-level names of the schedule and the compiled graphs: views onto the active engine's state
_STATE_VIEWS = {"remaining_schedule": "remaining_schedule", "next_passes": "next_passes",
                "param_manager": "param_manager", "graph_order_with_frame_id": "graph_order",
                "frames_partitioned": "frames_partitioned", "profiling_results": "profiling_results",
                "opt_pass_times": "opt_pass_times"}


def __getattr__(name: str) -> Any:
    if name in _STATE_VIEWS:
        return getattr(active_state(), _STATE_VIEWS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cleanup_compiled_backward_state(frame_id: Any = None, owned_frames: set | None = None) -> None:
    """Release captured backward state: of ``frame_id``, or of every frame in ``owned_frames`` (emptied), or of
    every frame. The last released frame restores ``torch.autograd.Function``."""
    if frame_id is not None:
        released = {frame_id}
        frames_needing_bwd.discard(frame_id)
        if owned_frames is not None:
            owned_frames.discard(frame_id)
    elif owned_frames is not None:
        released = set(owned_frames)
        frames_needing_bwd.difference_update(released)
        owned_frames.clear()
    else:
        released = set(frames_needing_bwd)
        frames_needing_bwd.clear()
    clear_backward_inputs(released)
    if not frames_needing_bwd:
        unpatch_compiled_func()


def register_compile_pass(name: str, opt_pass_fn: Callable, contract: Any = None) -> None:
    """Register a pass under ``name`` with its contract (None clears a contract registered before)."""
    from deepspeed.compile.passes.contract import register_pass_contract

    opt_passes[name] = opt_pass_fn
    register_pass_contract(name, contract)


def register_builtin_passes() -> None:
    """Register DeepCompile's own passes under their names (``zero3_compile``, ``prefetch``, ``selective_gather``,
    ``offload_parameters``, ``zero1_compile``, ``zero2_compile``) with their contracts, so a user schedule may name
    them; a name the user registered already is left alone."""
    from deepspeed.compile.passes import (
        offload_parameters,
        prefetch,
        selective_gather,
        zero3_compile,
        zero_1_and_2_compile,
    )

    for name, fn, contract in (
            (zero3_compile.NAME, zero3_compile.add_z3_gather_release, zero3_compile.CONTRACT),
            (prefetch.NAME, prefetch.schedule_prefetch, prefetch.CONTRACT),
            (selective_gather.NAME, selective_gather.selective_gather, selective_gather.CONTRACT),
            (offload_parameters.NAME, offload_parameters.offload_parameter_fwd, offload_parameters.CONTRACT),
            (zero_1_and_2_compile.NAME_Z1, zero_1_and_2_compile.add_z1_reduce, zero_1_and_2_compile.CONTRACT_Z1),
            (zero_1_and_2_compile.NAME_Z2, zero_1_and_2_compile.add_z2_reduce, zero_1_and_2_compile.CONTRACT_Z2)):
        if name not in opt_passes:
            register_compile_pass(name, fn, contract)


def init_schedule(schedule: list, state: DeepCompileState | None = None) -> None:
    """``[(global step, [pass, ...]), ...]``: the passes each graph gets from that step on (``state``: the engine's;
    default the active one)."""
    if not isinstance(schedule, list):
        raise TypeError(f"DeepCompile schedule must be a list of (step, passes), got {type(schedule).__name__}")
    for entry in schedule:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], int)
                and isinstance(entry[1], list)):
            raise TypeError(f"DeepCompile schedule entries are (int step, list of passes), got {entry!r}")
    (state or active_state()).remaining_schedule = deque(schedule)


def launch_compile_passes(global_steps: int, owned_frames: set | None = None,
                          state: DeepCompileState | None = None) -> None:
    """At a scheduled step: take that step's passes and forget everything ``state`` compiled before (Dynamo's
    caches included: they are process-wide, so another engine's graphs are captured again at its next call)."""
    state = state or active_state()
    remaining = state.remaining_schedule
    if not remaining or remaining[0][0] != global_steps:
        return
    _, state.next_passes = remaining.popleft()
    log_rank0(f"Launching compile passes: global_steps={global_steps} passes={state.next_passes}", True)
    torch._dynamo.reset()
    state.reset_compiled()
    cleanup_compiled_backward_state(owned_frames=owned_frames)


def set_time_and_tensor_size(graph_id: int, graph: Graph, mem: list, bwd: bool, results: dict,
                             mem_complete: bool = True) -> None:
    """Record a graph's per-node times, output sizes and memory profile in ``results[graph_id]``."""
    times = [(n.name, n.meta.get("device_time", 0.0), n.meta.get("wall_time", 0.0)) for n in graph.nodes]
    sizes = [(n.name, n.meta.get("tensor_size", 0)) for n in graph.nodes]
    side = "bwd" if bwd else "fwd"
    result = results[graph_id]
    for key, value in (("graph", graph), ("time", times), ("tensor_sizes", sizes), ("mem", mem),
                       ("mem_complete", mem_complete)):
        setattr(result, f"{side}_{key}", value)


def _real_value(v: Any, is_param: bool) -> Any:
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    if isinstance(v, torch.SymInt):
        return v.node.hint
    if not (isinstance(v, torch.Tensor) and is_fake(v)):
        return v
    shape = [s.node.hint if isinstance(s, torch.SymInt) else s for s in v.shape]
    stride = [s.node.hint if isinstance(s, torch.SymInt) else s for s in v.stride()]
    with unset_fake_temporarily():
        real = torch.zeros_strided(shape, stride, dtype=v.dtype, device=v.device) if hasattr(torch, "zeros_strided") \
            else torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device).zero_()
        real.requires_grad_(v.requires_grad)
        if is_param:
            real = torch.nn.Parameter(real, requires_grad=v.requires_grad)
            if hasattr(v, "ds_id"):
                real.ds_id = v.ds_id
    return real


def set_example_values_to_symints(real_inputs: Any, param_indices: list | None = None) -> tuple:
    """Inputs with symbolic sizes replaced by their hints and fake tensors by zero tensors of that shape."""
    params = {i for i, _, _ in param_indices or []}
    return tuple(_real_value(v, i in params) for i, v in enumerate(real_inputs))


def _get_fw_real_inputs(local_real_inputs: deque, input_storage: InputStorage, graph_id: int,
                        debug_log: bool = False) -> Any:
    """The forward graph's real inputs: those Dynamo passed (once), then rebuilt from ``input_storage``."""
    if local_real_inputs:
        return local_real_inputs.popleft()
    if input_storage.has_data():
        log_rank0(f"Retrieving real inputs from storage for graph_id={graph_id}", enable=debug_log)
        return input_storage.get()
    raise RuntimeError(f"DeepCompile: no real inputs for graph_id {graph_id} (the forward compiler ran again after "
                       "its inputs were consumed and nothing was stored)")


def _sync_memory_profile_complete(complete: bool, group: Any = None) -> bool:
    """True when every rank of ``group`` (default: the world) has a complete memory profile (a MIN; one process
    answers alone), so all ranks keep or drop the profile alike and the passes planning from it decide the same
    everywhere. Called once per profiled pass of a compiled graph: every rank compiles the same graphs."""
    if not dist.is_initialized():
        return complete
    current = get_accelerator().current_device()
    device = torch.device(get_accelerator().current_device_name() if isinstance(current, int) else current)
    flag = torch.tensor([1 if complete else 0], dtype=torch.int, device=device)
    if group is None:
        dist.all_reduce(flag, dist.ReduceOp.MIN)
    else:
        dist.all_reduce(flag, dist.ReduceOp.MIN, group=group)
    return bool(flag[0].item())


def _quiesce() -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        gc.collect()


def run_opt_passes(opt_passes: list[Callable], gm: GraphModule, graph_id: int, graph_order: list, profiling_results:
                   dict, create_inputs_fn: Callable, mem_budget: float, param_manager: dict, bwd: bool,
                   debug_log: bool = False) -> GraphModule:
    """Run ``opt_passes`` on ``gm`` in order. When a later pass of the step may plan from profiles (a step of more
    than one pass), each pass that changed the graph is followed by a memory profile on real inputs (one reduction
    over ranks for the whole run); a step of one pass profiles nothing."""
    with outside_python_dispatcher():
        return _run_opt_passes(opt_passes, gm, graph_id, graph_order, profiling_results, create_inputs_fn,
                               mem_budget, param_manager, bwd, debug_log)


def _run_opt_passes(opt_passes: list[Callable], gm: GraphModule, graph_id: int, graph_order: list,
                    profiling_results: dict, create_inputs_fn: Callable, mem_budget: float, param_manager: dict,
                    bwd: bool, debug_log: bool) -> GraphModule:
    from deepspeed.compile.profilers.graph_profile import MemoryProfilingInterpreter

    _quiesce()
    handle = get_deepcompile_handle()
    passes = list(opt_passes or [])
    for i, opt_pass in enumerate(passes):
        log_rank0(f"Running opt pass {i} for graph {graph_id}. bwd={bwd}", enable=debug_log)
        rewritten = opt_pass(gm, graph_id, graph_order, profiling_results, create_inputs_fn, mem_budget,
                             param_manager, bwd)
        if rewritten is not None:
            gm = rewritten
            gm.graph.lint()
            gm.recompile()
            if len(passes) == 1:
                continue  # no planning pass in this step reads a profile
            profiler = MemoryProfilingInterpreter(gm, debug_log=debug_log)
            handle.enable_profiling(True)  # reductions and stateful ops do not act during the profile run
            try:
                profiler.run(*create_inputs_fn())
            finally:
                handle.enable_profiling(False)
            complete = _sync_memory_profile_complete(profiler.profile_complete, handle.group)
            mem = list(profiler.mem_record) if complete else []
            set_time_and_tensor_size(graph_id, gm.graph, mem, bwd, profiling_results, complete)
        _quiesce()
    return gm


def _param_indices(real_inputs: Any) -> tuple[bool, list[tuple[int, int, Any]]]:
    """``(ZeRO-3?, [(input index, id, whole shape) per parameter input])``."""
    z3 = any(hasattr(v, "ds_id") for v in real_inputs)
    params = [(i, v) for i, v in enumerate(real_inputs) if isinstance(v, torch.nn.Parameter)]
    if z3:
        return True, [(i, v.ds_id, v.ds_shape) for i, v in params]
    missing = [i for i, v in params if not hasattr(v, "param_id")]
    if missing:
        raise RuntimeError(f"DeepCompile: parameter inputs {missing} carry no param_id (the engine registers every "
                           "parameter of the model; was the module compiled outside engine.compile()?)")
    return False, [(i, v.param_id, v.shape) for i, v in params]


def make_backend(backend: Any, compile_config: Any, compile_kwargs: dict | None = None,
                 owned_frames: set | None = None, state: DeepCompileState | None = None) -> Callable:
    """The Dynamo backend running DeepCompile's passes; ``backend``: ``"eager"`` or ``"inductor"``."""
    if backend not in ("eager", "inductor"):
        raise ValueError(f"DeepCompile: backend {backend!r} is not supported; accepted: 'eager', 'inductor'")
    register_custom_ops()
    register_builtin_passes()
    owned = set() if owned_frames is None else owned_frames
    owner_token = object()
    state = state or active_state()  # the engine's (engine.compile passes it); captured, never looked up again
    free_activation = compile_config.free_activation and not is_backend_inductor(backend)

    def backend_fn(gm: GraphModule, real_inputs: list) -> Any:
        compiler = GraphCompiler(gm, real_inputs, compile_config, owner_token, owned, free_activation, state)
        return compiler.compile(backend)

    return backend_fn


class GraphCompiler:
    """One captured graph through AOT autograd with DeepCompile's passes on its forward and backward graphs."""

    def __init__(self, gm: GraphModule, real_inputs: list, config: Any, owner_token: object, owned: set,
                 free_activation: bool, state: DeepCompileState) -> None:
        self.graph_id = id(gm.graph)
        self.frame_id = gm.meta["dynamo_compile_id"].frame_id
        self.frame_key = (owner_token, self.frame_id)
        self.state = state
        register_graph(self.graph_id, state)  # the dc operators this graph gets act on this engine's handle
        self.gm, self.real_inputs, self.config, self.owned = gm, real_inputs, config, owned
        self.free_activation = free_activation
        self.debug = bool(config.debug_log)
        self.state.graph_order.add_graph(self.graph_id, self.frame_id)
        self.z3, self.param_indices = _param_indices(real_inputs)
        # the forward compiler may run more than once (e.g. recompiling for backward): Dynamo's inputs serve the
        # first run, the storage rebuilds them for later ones
        self.local_inputs = deque([real_inputs])
        self.storage = InputStorage(keep_int_input_tensors=config.keep_int_input_tensors,
                                    keep_all_input_tensors=config.keep_all_input_tensors)
        self.storage.put(real_inputs)
        if self.graph_id not in state.profiling_results:
            state.profiling_results[self.graph_id] = ProfilingResult()
            state.profiling_results[self.graph_id].param_indices = self.param_indices

    def make_fw_graph(self, gm: GraphModule, sample_inputs: Any) -> Graph:
        from deepspeed.compile.partitioner import get_num_fwd_outputs

        activate(self.state)  # the passes and profilers reach this engine's handle as the active one
        started = time.time()
        index = len(self.state.graph_order) - 1
        # AOT autograd partitions the joint graph only when a backward is needed: the partitioner wrapper
        # recorded this frame if so
        needs_backward = self.frame_id in self.state.frames_partitioned
        self.state.graph_order.set_needs_backward(self.frame_id, needs_backward)
        result = self.state.profiling_results[self.graph_id]
        result.needs_backward = needs_backward
        result.num_fwd_outputs = get_num_fwd_outputs(self.frame_id)
        if needs_backward:
            if not frames_needing_bwd:
                patch_compiled_func()
            frames_needing_bwd.add(self.frame_key)
            self.owned.add(self.frame_key)
            register_backward_frame(self.frame_key)
        inputs = _get_fw_real_inputs(self.local_inputs, self.storage, self.graph_id, debug_log=self.debug)
        inputs = set_example_values_to_symints(inputs)
        self.state.param_manager[self.graph_id] = DSGraphParamManager(gm.graph, inputs, self.param_indices)
        with_rng = inputs + tuple(sample_inputs[len(inputs):])
        run_opt_passes(self.state.next_passes, gm, self.graph_id, self.state.graph_order.get_graph_order(),
                       self.state.profiling_results, lambda: with_rng, 0.0, self.state.param_manager, False, self.debug)
        self.state.opt_pass_times.append(("fwd", index, self.graph_id, time.time() - started))
        return gm.graph

    def make_bw_graph(self, gm: GraphModule, sample_inputs: Any) -> Graph:
        activate(self.state)  # compiled at the first backward, maybe after another engine's forward
        started = time.time()
        order = self.state.graph_order.get_graph_order()
        index = get_index_by_graph_id(order, self.graph_id)
        inputs = pop_backward_input(self.frame_key)
        manager = self.state.param_manager[self.graph_id]
        param_nodes_bw, _ = manager.get_bwd_mapping(gm.graph)
        if inputs is None:
            # compiled ahead of the first backward (symbolic sizes saved for backward): profile on zeros
            log_rank0(f"Generating dummy backward inputs for profiling. graph_id={self.graph_id}", enable=self.debug)
            inputs = set_example_values_to_symints(manager.replace_fake_tensors_with_real_params(sample_inputs,
                                                                                                  gm.graph))
        inputs = tuple(inputs)
        state = self.state
        run_opt_passes(state.next_passes, gm, self.graph_id, order, state.profiling_results, lambda: inputs, 0.0,
                       state.param_manager, True, self.debug)
        if self.free_activation:
            names = {n.name for n in param_nodes_bw}
            others = [n.name for n in get_input_nodes(gm.graph) if n.name not in names]
            add_free_activations(self.graph_id, gm.graph,
                                 get_activation_node_names(gm.graph, param_nodes_bw, others))
        cleanup_compiled_backward_state(self.frame_key, self.owned)
        self.state.opt_pass_times.append(("bwd", index, self.graph_id, time.time() - started))
        return gm.graph

    def compile(self, backend: str) -> Any:
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        from deepspeed.compile.partitioner import get_wrapped_partitioner

        if backend == "eager":

            def compiler(make_graph: Callable) -> Callable:
                def compile_graph(gm: GraphModule, sample_inputs: Any) -> Any:
                    return None if make_graph(gm, sample_inputs) is None else make_boxed_func(gm.forward)

                return compile_graph

            partition_fn = get_wrapped_partitioner(self.z3, self.param_indices, min_cut_rematerialization_partition,
                                                   self.frame_id, self.state.frames_partitioned)
            return aot_module_simplified(self.gm, self.real_inputs, fw_compiler=compiler(self.make_fw_graph),
                                         bw_compiler=compiler(self.make_bw_graph), partition_fn=partition_fn)
        restore = patch_create_aot_dispatcher_function(self.graph_id, self.z3, self.make_fw_graph,
                                                       self.make_bw_graph, self.real_inputs, self.param_indices,
                                                       self.state.param_manager, self.frame_id,
                                                       self.state.frames_partitioned)
        try:
            return torch._inductor.compile(self.gm, self.real_inputs)
        finally:
            restore()  # AotAutograd's constructor is process-wide: never leave this graph's wiring on it

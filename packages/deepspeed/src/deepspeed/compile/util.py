"""DeepCompile's shared helpers (``deepspeed.compile.util``): the runtime handle, the backward hooks the engine
runs around a DeepCompile backward, and FX graph queries the passes share (inputs, last uses, sizes).

Other passes may append their own small helpers here.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_aggregate, map_arg

from deepspeed.accelerator import get_accelerator
from deepspeed.compile.custom_ops import dc_ops
from deepspeed.compile.custom_ops.handle import DeepCompileHandle
from deepspeed.compile.state import active_state, get_handle
from deepspeed.utils.torch import required_torch_version


def is_deepcompile_supported() -> bool:
    """DeepSpeed's answer (PyTorch >= 2.6 on CUDA), which its tests use to skip. This implementation's ops are
    Python ``torch.library`` ops over ``torch.distributed``, so ``engine.compile`` runs DeepCompile on the CPU
    as well; only the tests' gate keeps DeepSpeed's meaning."""
    return required_torch_version(min_version=2.6) and get_accelerator().device_name() == "cuda"


def get_deepcompile_handle() -> DeepCompileHandle:
    """The active engine's DeepCompile runtime (parameter registry, gathered values, gradient reduction; see
    ``compile.state``); DeepSpeed's compiled ``dc`` extension. Loading it registers the ``torch.ops.dc`` operators."""
    dc_ops.register()
    return get_handle()


def is_backend_inductor(backend: Any) -> bool:
    return backend == "inductor"


def __getattr__(name: str) -> Any:
    # DeepSpeed's module-level names for the backward hooks: views onto the active engine's state
    if name in ("backward_started", "pre_backward_hooks", "post_backward_hooks"):
        return getattr(active_state(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_pre_backward_hook(hook: Callable[[bool], None]) -> None:
    active_state().pre_backward_hooks.append(hook)


def add_post_backward_hook(hook: Callable[[], None]) -> None:
    active_state().post_backward_hooks.append(hook)


def remove_backward_hooks(hooks: list[Callable[..., Any]]) -> None:
    """Drop hooks one engine added from the active state's lists (its own state's are dropped with it)."""
    state = active_state()
    for hook in hooks:
        for registry in (state.pre_backward_hooks, state.post_backward_hooks):
            while hook in registry:
                registry.remove(hook)


def deepcompile_backward_prologue(is_gradient_accumulation_boundary: bool) -> None:
    state = active_state()
    state.backward_started = True
    for hook in state.pre_backward_hooks:
        hook(is_gradient_accumulation_boundary)
    get_deepcompile_handle().start_backward(is_gradient_accumulation_boundary)


def deepcompile_backward_epilogue() -> None:
    state = active_state()
    for hook in state.post_backward_hooks:
        hook()
    state.backward_started = False


def log_rank0(msg: str, enable: bool = False) -> None:
    if not enable:
        return
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        print(msg)


@functools.lru_cache(maxsize=1)
def get_no_copy_ops() -> frozenset:
    """Operators whose output may alias an input (views, in-place ops, ``dc.wait_allgather``): a value read
    through one of them is still in use while the alias is."""
    get_deepcompile_handle()
    ops = {torch.ops.dc.wait_allgather.default}
    for op_name in torch.ops.aten:
        packet = getattr(torch.ops.aten, op_name)
        for overload in packet:
            op = getattr(packet, overload)
            schema = getattr(op, "_schema", None)
            if schema is None or any(isinstance(r.type, torch.TensorType) and r.alias_info is not None
                                     for r in schema.returns):
                ops.add(op)
    return frozenset(ops)


def _swap_visit(visit: Callable[[Node, Node], None], user: Node, n: Node) -> None:
    visit(n, user)


def get_input_nodes(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def get_param_nodes(graph: Graph, index_to_ds_ids: list[tuple[int, int, Any]]) -> list[Node]:
    inputs = get_input_nodes(graph)
    return [inputs[i] for i, _, _ in index_to_ds_ids]


def is_comm_op(node: Node) -> bool:
    return bool(node.meta.get("comm", False))


def is_cast_op(node: Node) -> tuple[bool, torch.dtype | None]:
    if node.op == "call_function":
        if node.target == torch.ops.prims.convert_element_type.default:
            return True, node.args[1]
        if node.target == torch.ops.aten._to_copy.default and set(node.kwargs) == {"dtype"}:
            return True, node.kwargs["dtype"]
    return False, None


def dtype_to_elem_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.finfo(dtype).bits // 8 * (2 if dtype.is_complex else 1)
    if dtype == torch.bool:
        return 1
    return torch.iinfo(dtype).bits // 8


def tensor_meta_size(tensor_meta: Any) -> int:
    """Bytes of a tensor described by FX ``tensor_meta`` (shape and dtype)."""
    numel = functools.reduce(operator.mul, tensor_meta.shape, 1)
    return int(numel) * dtype_to_elem_size(tensor_meta.dtype)


def materialize_fake(v: Any, device: Any = None) -> Any:
    """Real tensors (random floats, zero integers) in place of fake ones, e.g. to run a graph for profiling."""
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    def convert(t: Any) -> Any:
        if not is_fake(t):
            return t
        with unset_fake_temporarily():
            where = t.device if device is None else device
            if t.is_floating_point():
                return torch.randn(t.shape, dtype=t.dtype, device=where, requires_grad=t.requires_grad)
            return torch.zeros(t.shape, dtype=t.dtype, device=where)

    return map_aggregate(v, convert)


def get_last_uses(graph: Graph) -> tuple[dict[Node, Node], dict[Node, list[Node]]]:
    """``(node -> its last user, user -> the nodes it uses last)``; a use through an aliasing op
    (``get_no_copy_ops``) lasts as long as the alias does."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    no_copy = get_no_copy_ops()
    last_use: dict[Node, Node] = {}
    last_uses_of: dict[Node, list[Node]] = {}

    def visit(n: Node, user: Node) -> None:
        effective = last_use.get(user, user) if user.target in no_copy else user
        known = last_use.get(n)
        if known is not None and position[effective] <= position[known]:
            return
        last_use[n] = effective
        last_uses_of.setdefault(effective, []).append(n)
        if known is not None:
            last_uses_of[known].remove(n)

    for node in reversed(graph.nodes):
        map_arg((node.args, node.kwargs), functools.partial(_swap_visit, visit, node))
    return last_use, last_uses_of


def get_real_uses(graph: Graph) -> dict[Node, list[Node]]:
    """Node -> the nodes that read its value, looking through aliasing ops to their users (output excluded)."""
    uses: dict[Node, list[Node]] = defaultdict(list)
    no_copy = get_no_copy_ops()

    def visit(n: Node, user: Node) -> None:
        if user.target == "output":
            return
        if user.target in no_copy:
            uses[n].extend(uses[user])
        else:
            uses[n].append(user)

    for node in reversed(graph.nodes):
        map_arg((node.args, node.kwargs), functools.partial(_swap_visit, visit, node))
    return uses


def get_activation_node_names(graph: Graph, param_nodes_bw: list[Node], fwd_output_names: list[str]) -> list[str]:
    """Backward inputs that are saved forward values (not parameters)."""
    params = {n.name for n in param_nodes_bw}
    outputs = set(fwd_output_names)
    return [n.name for n in get_input_nodes(graph) if n.name in outputs and n.name not in params]


def is_release_node(n: Node) -> bool:
    return n.target == torch.ops.dc.release_param.default


def get_index_by_graph_id(graph_order: list[tuple[int, bool]], target_graph_id: int) -> int:
    for index, (graph_id, _) in enumerate(graph_order):
        if graph_id == target_graph_id:
            return index
    return -1


# AutoSP's graph helpers, at DeepSpeed's path (they live in sp_graph)
from deepspeed.compile.sp_graph import (  # noqa: E402, F401
    create_shard_offsets,
    create_symbolic_slice_indices,
    get_input_id_node,
    get_label_id_node,
    get_position_id_node,
    get_sdpa_nodes,
    shard_tensor_node,
)

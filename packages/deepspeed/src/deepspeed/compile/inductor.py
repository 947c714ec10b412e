"""DeepCompile under the ``inductor`` backend: Inductor builds its AOT autograd backend itself, so DeepCompile
wraps the compilers and partitioner that ``AotAutograd`` is constructed with (``patch_create_aot_dispatcher_function``,
restorable) rather than calling AOT autograd directly as it does for ``eager``.

- ``patch_compiler``: the forward/backward compiler runs DeepCompile's graph rewriting (``dc_compiler``) first; under
  ZeRO-3 the compiler then sees each parameter input as the empty tensor the released parameter really is;
- ``wrap_partition_fn``: the partitioner records that the frame has a backward (and, ZeRO-3, recomputes
  parameter aliases instead of saving them); the parameter placeholders' example values become empty tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from deepspeed.compile.custom_ops import dc_ops
from deepspeed.compile.graph_param import DSGraphParamManager
from deepspeed.compile.util import get_input_nodes


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


def register_custom_ops() -> None:
    """Make the ``dc`` operators safe in compiled graphs: defined, and kept by dead-code elimination although
    several return nothing (Inductor runs every custom operator it has no lowering for as a fallback kernel)."""
    dc_ops.register()

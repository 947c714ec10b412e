"""DeepCompile's core: the ``torch.ops.dc`` operators over the runtime handle (2 real gloo ranks), FX helpers,
backward-input capture, input storage and the ZeRO-3 Dynamo-settings claims."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch
import torch.distributed as dist
from _harness import run_distributed
from torch.fx import Graph

from deepspeed.compile import backend as backend_mod
from deepspeed.compile.fx import add_end_backward, get_output_node, replace_reduce_outputs_with_none
from deepspeed.compile.init_z3 import _allow_dynamo_dynamic_parameter_shapes_for_z3
from deepspeed.compile.input_storage import InputStorage
from deepspeed.compile.patch_compiled_func import get_backward_inputs, patch_compiled_func, unpatch_compiled_func
from deepspeed.compile.util import get_deepcompile_handle


def _partitioned(ds_id: int, full: torch.Tensor, rank: int, world: int) -> torch.nn.Parameter:
    """A parameter shaped like a released ZeRO-3 one: empty data, this rank's padded slice in ds_tensor."""
    part = -(-full.numel() // world)
    flat = torch.zeros(part * world)
    flat[:full.numel()] = full.reshape(-1)
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_id, p.ds_shape, p.ds_numel = ds_id, full.shape, full.numel()
    p.ds_tensor = flat[rank * part:(rank + 1) * part].clone()
    p.ds_space = SimpleNamespace(world=world, group=None, compute_device=torch.device("cpu"))
    return p


def _gather_and_reduce() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(7, dtype=torch.float32).reshape(7, 1)
    handle = get_deepcompile_handle()
    handle.cleanup()
    p = _partitioned(3, full, rank, world)
    handle.register_z3_param(p)
    received = []
    handle.set_grad_sink(lambda param, grad: received.append((param.ds_id, grad.clone())))
    gathered = torch.ops.dc.allgather_param.default(p, 0, 3)
    again = torch.ops.dc.allgather_param.default(p, 0, 3)  # kept until released: no second exchange
    gathers_before_release = handle.gathers
    torch.ops.dc.release_param.default(gathered, 0, 3, 1)
    torch.ops.dc.allgather_param.default(p, 0, 3)
    out = torch.ops.dc.reduce_grad.default(torch.full((7, 1), float(rank)), 0, 3)
    handle.enable_profiling(True)  # a profiling run does not hand gradients to the engine
    torch.ops.dc.reduce_grad.default(torch.ones(7, 1), 0, 3)
    handle.enable_profiling(False)
    return {"equal": torch.equal(gathered, full), "same": again is gathered, "gathers": gathers_before_release,
            "after_release": handle.gathers, "received": [(i, g.flatten().tolist()) for i, g in received],
            "out_numel": out.numel()}


def test_allgather_release_and_reduce_over_two_ranks():
    results = run_distributed(_gather_and_reduce, world_size=2, timeout=60)
    for rank, r in enumerate(results):
        assert r["equal"] and r["same"]
        assert (r["gathers"], r["after_release"]) == (1, 2)
        assert r["received"] == [(3, [float(rank)] * 7)]
        assert r["out_numel"] == 0


def test_end_backward_follows_reductions_and_outputs_drop_reduced_grads():
    get_deepcompile_handle()
    graph = Graph()
    grad = graph.placeholder("grad")
    reduced = graph.call_function(torch.ops.dc.reduce_grad.default, (grad, 5, 1))
    graph.output((reduced, grad))
    add_end_backward(graph, 5)
    replace_reduce_outputs_with_none(graph)
    graph.lint()
    end = [n for n in graph.nodes if n.target == torch.ops.dc.end_backward.default]
    assert len(end) == 1 and end[0].args[0] == [reduced] and end[0].args[1] == 5
    assert get_output_node(graph).args == ((None, grad), )


def test_backward_input_capture_is_released_with_its_frames():
    original = torch.autograd.Function
    owner = object()
    frames = {(owner, 1)}
    backend_mod.frames_needing_bwd.update(frames)
    patch_compiled_func()
    try:
        assert torch.autograd.Function is not original
        get_backward_inputs()[(owner, 1)] = [(torch.ones(1), )]
        backend_mod.cleanup_compiled_backward_state(owned_frames=frames)
        assert frames == set() and get_backward_inputs() == {}
        assert torch.autograd.Function is original
    finally:
        backend_mod.frames_needing_bwd.clear()
        unpatch_compiled_func()


def test_input_storage_keeps_integer_values_and_rebuilds_float_shapes():
    storage = InputStorage(keep_int_input_tensors=True)
    ids = torch.tensor([[3, 1, 2]])
    storage.put((ids, torch.randn(2, 5)))
    rebuilt_ids, rebuilt_float = storage.get()
    assert torch.equal(rebuilt_ids, ids) and rebuilt_ids is not ids
    assert rebuilt_float.shape == (2, 5) and torch.equal(rebuilt_float, torch.ones(2, 5))
    assert backend_mod._get_fw_real_inputs(deque(), storage, graph_id=1)[0].dtype == torch.int64


def test_dynamo_static_shape_settings_return_after_the_last_claim():
    config = torch._dynamo.config
    before = (config.force_parameter_static_shapes, config.force_nn_module_property_static_shapes)
    first, second = (_allow_dynamo_dynamic_parameter_shapes_for_z3({}) for _ in range(2))
    try:
        first()
        first()  # idempotent
        assert config.force_parameter_static_shapes is False
    finally:
        second()
    assert (config.force_parameter_static_shapes, config.force_nn_module_property_static_shapes) == before

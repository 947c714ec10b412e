"""DeepCompile's graph scheduling: pass contracts, fast_free_schedule, prefetch, offload_parameters and the ZeRO-3
partitioner hook, on hand-built FX graphs of ZeRO-3's dc operators (no compile, no ranks)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from deepspeed.compile import list_schedule, partitioner
from deepspeed.compile.passes import contract as contract_mod
from deepspeed.compile.passes import offload_parameters, prefetch
from deepspeed.compile.passes.contract import (
    PassContract,
    PassContractError,
    get_pass_contract,
    register_pass_contract,
    validate_schedule,
)
from deepspeed.compile.profilers import ProfilingResult
from deepspeed.compile.util import get_deepcompile_handle

get_deepcompile_handle()  # registers the torch.ops.dc operators
DC = torch.ops.dc


# ---- graphs ----------------------------------------------------------------------------------------------------
def _z3_graph(sizes: list[int], times: list[float], gather_all_first: bool = True) -> Graph:
    """x * w0 * w1 * ... with each w_i a gathered ZeRO-3 parameter, as zero3_compile writes it: allgather + wait
    before the use, release after it. ``gather_all_first``: every all-gather at the top (the worst order)."""
    g = Graph()
    x = g.placeholder("x")
    params = [g.placeholder(f"p{i}") for i in range(len(sizes))]

    def gather(i: int) -> Node:
        ag = g.create_node("call_function", DC.allgather_param.default, (params[i], 0, i), {"dtype": torch.float32},
                           name=f"allgather_ds_param_p{i}_{i}")
        ag.meta.update(tensor_size=sizes[i], device_time=1.0)
        wait = g.create_node("call_function", DC.wait_allgather.default, (ag, 0, i), name=f"wait_allgather_p{i}")
        return wait

    waits = [gather(i) for i in range(len(sizes))] if gather_all_first else []
    h = x
    for i in range(len(sizes)):
        w = waits[i] if gather_all_first else gather(i)
        h = g.create_node("call_function", operator.mul, (h, w), name=f"use{i}")
        h.meta["device_time"] = times[i]
        h = g.create_node("call_function", DC.release_param.default, (h, 0, i, 1), name=f"release_ds_param_p{i}_{i}")
    g.output(h)
    g.lint()
    return g


def _gathered_peak(nodes) -> int:
    """Most gathered-parameter bytes alive at once along ``nodes`` (a gather adds, a release of its id frees)."""
    alive, peak, size_of = 0, 0, {}
    for n in nodes:
        if n.target == DC.allgather_param.default:
            size_of[n.args[2]] = n.meta["tensor_size"]
            alive += n.meta["tensor_size"]
        elif n.target == DC.release_param.default:
            alive -= size_of.get(n.args[2], 0)
        peak = max(peak, alive)
    return peak


def _names(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes]


# ---- contracts -------------------------------------------------------------------------------------------------
@pytest.fixture
def registry():
    saved = dict(contract_mod._pass_contracts)
    contract_mod._pass_contracts.clear()
    yield
    contract_mod._pass_contracts.clear()
    contract_mod._pass_contracts.update(saved)


def test_contract_requirement_met_only_within_the_step(registry):
    register_pass_contract("z3", PassContract(provides={"gather"}))
    register_pass_contract("pf", PassContract(requires={"gather"}))
    validate_schedule([(0, ["z3", "pf"]), (5, ["z3", "unknown", "pf"])])
    with pytest.raises(PassContractError, match=r"'pf' at step 5 requires \['gather'\]"):
        validate_schedule([(0, ["z3"]), (5, ["pf"])])
    with pytest.raises(PassContractError, match="requires"):
        validate_schedule([(0, ["pf", "z3"])])  # provider after the consumer


def test_contract_conflicts_either_side_and_callables(registry):
    register_pass_contract("a", PassContract(conflicts_with={"b"}))

    def b_fn():
        pass

    for order in (["a", b_fn], [b_fn, "a"]):
        with pytest.raises(PassContractError, match="conflicts with"):
            validate_schedule([(3, order)], {"b": b_fn})
    validate_schedule([(3, ["a", b_fn])])  # without the registry the callable is anonymous
    with pytest.raises(PassContractError, match="multiple names"):
        validate_schedule([(0, [b_fn])], {"b": b_fn, "b2": b_fn})


def test_contract_registration_and_bad_input(registry):
    c = PassContract(provides=["x"], phase="forward")
    assert c.provides == frozenset({"x"})
    register_pass_contract("p", c)
    assert get_pass_contract("p") is c
    register_pass_contract("p", None)
    assert get_pass_contract("p") is None
    with pytest.raises(TypeError, match="provides"):
        PassContract(provides="x")
    with pytest.raises(ValueError, match="phase"):
        PassContract(phase="sideways")
    with pytest.raises(TypeError, match="PassContract or None"):
        register_pass_contract("p", {"provides": "x"})
    with pytest.raises(PassContractError, match=r"\(step, \[passes\]\)"):
        validate_schedule([0, ["p"]])


def test_builtin_scheduling_contracts_need_zero3_gathers():
    for mod in (prefetch, offload_parameters):
        assert contract_mod.CAP_Z3_GATHER_RELEASE in mod.CONTRACT.requires
    from deepspeed.compile.passes import selective_gather
    assert selective_gather.CONTRACT.requires == {contract_mod.CAP_Z3_GATHER_RELEASE}


# ---- fast_free_schedule ----------------------------------------------------------------------------------------
def test_fast_free_schedule_frees_each_parameter_before_the_next_gather():
    g = _z3_graph([100, 200, 300, 400], [1.0, 2.0, 3.0, 4.0])
    assert _gathered_peak(g.nodes) == 1000
    new = list_schedule.fast_free_schedule(g, 0, 0, debug_log=False)
    new.lint()
    assert sorted(_names(new)) == sorted(_names(g))
    assert _gathered_peak(new.nodes) == 400  # one parameter at a time
    names = _names(new)
    for i in range(3):
        assert names.index(f"release_ds_param_p{i}_{i}") < names.index(f"allgather_ds_param_p{i + 1}_{i + 1}")
    assert names[:5] == ["x", "p0", "p1", "p2", "p3"]  # inputs stay first, in order


def test_fast_free_schedule_keeps_dependencies_on_a_deep_graph():
    # 2,000 parameters: a recursive walk would exceed Python's recursion limit
    n = 2000
    g = _z3_graph([1] * n, [0.0] * n, gather_all_first=False)
    new = list_schedule.fast_free_schedule(g, 0, 0, debug_log=False)
    new.lint()  # every input defined before use
    assert len(new.nodes) == len(g.nodes)
    assert _gathered_peak(new.nodes) == 1


def test_fast_free_schedule_runs_reductions_once_their_gathers_are_out():
    g = Graph()
    p0, p1, grad = g.placeholder("p0"), g.placeholder("p1"), g.placeholder("grad")
    ag0 = g.call_function(DC.allgather_param.default, (p0, 0, 0))
    ag1 = g.call_function(DC.allgather_param.default, (p1, 0, 1))
    ag0.meta["tensor_size"] = ag1.meta["tensor_size"] = 10
    use0 = g.call_function(operator.mul, (grad, ag0))
    rel0 = g.call_function(DC.release_param.default, (use0, 0, 0, 1))
    red0 = g.call_function(DC.reduce_grad.default, (rel0, 0, 0))
    use1 = g.call_function(operator.mul, (grad, ag1))
    rel1 = g.call_function(DC.release_param.default, (use1, 0, 1, 1))
    red1 = g.call_function(DC.reduce_grad.default, (rel1, 0, 1))
    g.output((red0, red1))
    names = _names(list_schedule.fast_free_schedule(g, 0, 0, debug_log=False))
    (first_ag, first_red), (second_ag, _) = sorted([(ag0, red0), (ag1, red1)], key=lambda p: names.index(p[0].name))
    assert names.index(first_red.name) < names.index(second_ag.name)


def test_node_requirements_are_the_unscheduled_ancestors_in_order():
    g = _z3_graph([1, 1], [0.0, 0.0], gather_all_first=False)
    out = next(n for n in g.nodes if n.op == "output")
    placeholders = {n for n in g.nodes if n.op == "placeholder"}
    req = list_schedule.get_node_requirements(out.args[0], placeholders)
    assert [n.name for n in req] == [n.name for n in g.nodes if n.op not in ("placeholder", "output")]


# ---- prefetch --------------------------------------------------------------------------------------------------
def _predictor(size: float) -> float:
    return 0.0 if size == 0 else 1.0 + size / 100  # latency-bound: fusing pays


def _prefetch_groups(order) -> list[list[int]]:
    return [[prefetch.get_ds_id(ag) for ag in step] for step in order if not isinstance(step, Node)]


def test_prefetch_fuses_everything_at_the_head_when_memory_allows():
    g = _z3_graph([10] * 4, [1.0] * 4, gather_all_first=False)
    nodes = list(g.nodes)
    order = prefetch.plan_prefetch(nodes, {n.name: 100 for n in nodes}, {n.name: 10 for n in nodes}, _predictor,
                                   max_mem=1e6)
    assert _prefetch_groups(order) == [[0, 1, 2, 3]]
    head = [s.name if isinstance(s, Node) else "PREFETCH" for s in order[:6]]
    assert head == ["x", "p0", "p1", "p2", "p3", "PREFETCH"]


def test_prefetch_keeps_in_flight_bytes_under_the_limit():
    g = _z3_graph([10] * 6, [1.0] * 6, gather_all_first=False)
    nodes = list(g.nodes)
    peaks = {n.name: 100 for n in nodes}
    order = prefetch.plan_prefetch(nodes, peaks, {n.name: 10 for n in nodes}, _predictor, max_mem=115)
    groups = _prefetch_groups(order)
    assert sorted(i for grp in groups for i in grp) == list(range(6))
    assert len(groups) > 1  # all six at the head would put 50 bytes in flight
    in_flight: dict[int, int] = {}
    for step in order:  # prefetched bytes not yet reached by their all-gather, on top of each node's peak
        if not isinstance(step, Node):
            in_flight.update((prefetch.get_ds_id(ag), 10) for ag in step)
        elif step.target == DC.allgather_param.default:
            assert step.args[2] in in_flight  # prefetched before it is needed
            in_flight.pop(step.args[2])
        else:
            assert peaks[step.name] + sum(in_flight.values()) <= 115, step.name


def test_prefetch_never_moves_above_a_producer_or_an_earlier_release_of_the_parameter():
    g = Graph()
    x, p = g.placeholder("x"), g.placeholder("p")
    ag_a = g.call_function(DC.allgather_param.default, (p, 0, 7))
    use_a = g.call_function(operator.mul, (x, ag_a))
    rel_a = g.call_function(DC.release_param.default, (use_a, 0, 7, 1))
    q = g.call_function(operator.neg, (p, ))  # a computed gather input
    ag_q = g.call_function(DC.allgather_param.default, (q, 0, 8))
    ag_b = g.call_function(DC.allgather_param.default, (p, 0, 7))  # the same parameter gathered again
    out = g.call_function(operator.add, (g.call_function(operator.mul, (ag_b, ag_q)), rel_a))
    g.output(out)
    nodes = list(g.nodes)
    order = prefetch.plan_prefetch(nodes, {}, {n.name: 1 for n in nodes}, lambda s: 0.0, max_mem=1e6)
    flat = [step.name if isinstance(step, Node) else tuple(a.name for a in step) for step in order]
    pf_b, pf_q = flat.index((ag_b.name, )), flat.index((ag_q.name, ))
    assert flat.index(rel_a.name) < pf_b < flat.index(ag_b.name)
    assert flat.index(q.name) < pf_q < flat.index(ag_q.name)
    assert flat.index((ag_a.name, )) == 2  # the first gather of p may go right after the inputs


def test_schedule_prefetch_rewrites_the_graph_module(monkeypatch):
    g = _z3_graph([10] * 3, [1.0] * 3, gather_all_first=False)
    gm = GraphModule(torch.nn.Module(), g)
    names = [n.name for n in g.nodes]
    profile = ProfilingResult(fwd_graph=g, fwd_mem=[(n, 0, 0, 100) for n in names],
                              fwd_tensor_sizes=[(n, 10) for n in names])
    monkeypatch.setattr(prefetch, "create_predictor", lambda: _predictor)
    out = prefetch.schedule_prefetch(gm, 0, [(0, True)], {0: profile}, None, 0.0, None, bwd=False)
    assert out is gm
    fused = [n for n in gm.graph.nodes if n.target == DC.prefetch_params_fused.default]
    assert len(fused) == 1
    graph_id, params, ds_ids, dtypes = fused[0].args
    assert (graph_id, [p.name for p in params], ds_ids, dtypes) == (0, ["p0", "p1", "p2"], [0, 1, 2],
                                                                    [torch.float32] * 3)
    assert "prefetch_params_fused" in gm.code


def test_schedule_prefetch_leaves_an_incomplete_profile_alone(monkeypatch, capsys):
    g = _z3_graph([10], [1.0])
    gm = GraphModule(torch.nn.Module(), g)
    monkeypatch.setattr(prefetch, "create_predictor", lambda: pytest.fail("must not measure"))
    prefetch.schedule_prefetch(gm, 3, [], {3: ProfilingResult(fwd_graph=g, fwd_mem_complete=False)}, None, 0.0, None,
                               bwd=False)
    assert gm.graph is g
    assert "incomplete profiling data" in capsys.readouterr().out


# ---- offload_parameters ----------------------------------------------------------------------------------------
def test_offload_parameters_reloads_after_inputs_and_offloads_after_last_use():
    gm = GraphModule(torch.nn.Module(), _z3_graph([4, 4], [1.0, 1.0], gather_all_first=False))
    offload_parameters.offload_parameter_fwd(gm, 5, [(5, True)], {}, None, 0.0, None, bwd=False)
    nodes = list(gm.graph.nodes)
    names = [n.name for n in nodes]
    reloads = [n for n in nodes if n.target == DC.reload_parameter.default]
    offloads = [n for n in nodes if n.target == DC.offload_parameter.default]
    assert [n.op for n in nodes[:3]] == ["placeholder"] * 3
    assert [(r.args[0].name, r.args[1], r.args[2]) for r in reloads] == [("p0", 5, 0), ("p1", 5, 1)]
    assert names.index(reloads[-1].name) == 4  # right after the inputs, in gather order
    for i, off in enumerate(offloads):
        assert off.args[0].name == f"use{i}" and off.args[2] == i
        assert names.index(off.name) == names.index(f"use{i}") + 1


# ---- partitioner -----------------------------------------------------------------------------------------------
def test_partitioner_recomputes_param_views_and_casts_transitively():
    aten = torch.ops.aten
    g = Graph()
    act, param = g.placeholder("primals_1"), g.placeholder("primals_2")
    tangent = g.placeholder("tangents_1")
    view = g.call_function(aten.view.default, (param, [4]))
    tr = g.call_function(aten.t.default, (view, ))
    cast = g.call_function(torch.ops.prims.convert_element_type.default, (param, torch.bfloat16))
    act_view = g.call_function(aten.view.default, (act, [4]))
    mm = g.call_function(aten.mm.default, (act_view, tr))
    g.output((mm, cast, tangent))
    calls = []

    def partition_fn(joint, inputs, *, num_fwd_outputs, **kw):
        calls.append((num_fwd_outputs, kw))
        return joint, joint

    frames: set[int] = set()
    fn = partitioner.get_wrapped_partitioner(True, [(1, 11, torch.Size([4]))], partition_fn, 42, frames)
    fn(GraphModule(torch.nn.Module(), g), [], num_fwd_outputs=2, extra=1)
    assert calls == [(2, {"extra": 1})] and frames == {42}
    assert partitioner.get_num_fwd_outputs(42) == 2
    marked = {n.name for n in g.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
    assert marked == {view.name, tr.name, cast.name}
    assert all(n.meta["ac_graph_id"] == 1 for n in g.nodes)


def test_partitioner_without_zero3_leaves_the_graph_alone():
    g = Graph()
    p = g.placeholder("primals_1")
    v = g.call_function(torch.ops.aten.view.default, (p, [1]))
    g.output(v)
    fn = partitioner.get_wrapped_partitioner(False, [(0, 1, torch.Size([1]))], lambda j, i, **k: (j, j), 7, set())
    fn(GraphModule(torch.nn.Module(), g), [], num_fwd_outputs=1)
    assert "recompute" not in v.meta


# ---- zero1_compile / zero2_compile -----------------------------------------------------------------------------
def test_zero1_reduces_each_gradient_in_the_backward_graph():
    from deepspeed.compile.graph_param import DSGraphParamManager
    from deepspeed.compile.passes import zero_1_and_2_compile as z12

    x, w0, w1 = torch.randn(3, 4), torch.randn(4, 4), torch.randn(4, 4)
    fw = Graph()
    for name in ("x", "w0", "w1"):
        fw.placeholder(name)
    fw.output(None)
    params = [torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w1.clone())]
    for i, p in enumerate(params):
        p.param_id = 100 + i
    manager = DSGraphParamManager(fw, [x, *params], [(1, 100, w0.shape), (2, 101, w1.shape)])
    bw = Graph()
    bx, tangent, bw0, bw1 = (bw.placeholder(n) for n in ("x", "tangents_1", "w0", "w1"))
    g0 = bw.call_function(torch.matmul, (bw.call_function(torch.t, (bx, )), tangent))
    g1 = bw.call_function(operator.mul, (g0, 2.0))
    bw.output((None, g0, g1))
    gm = z12.add_z2_reduce(GraphModule(torch.nn.Module(), bw), 7, [(7, True)], {}, None, 0.0, {7: manager}, True)

    assert z12.add_z1_reduce(gm, 7, [], {}, None, 0.0, {7: manager}, False) is gm  # forward: unchanged
    names = [n.name for n in gm.graph.nodes]
    assert [n.op for n in gm.graph.nodes][:4] == ["placeholder"] * 4
    assert names.index("reduce_param_w0") < names.index("reduce_param_w1") < names.index("end_backward_default")
    handle = get_deepcompile_handle()
    handle.cleanup()
    received = []
    try:
        for p in params:
            handle.register_param(p)
        handle.set_grad_sink(lambda param, grad: received.append((param.param_id, grad.clone())))
        t = torch.randn(3, 4)
        out = gm(x, t, *params)
    finally:
        handle.cleanup()
    expected = x.t() @ t
    assert out == (None, None, None)  # the reducer owns the gradients
    assert [i for i, _ in received] == [100, 101]
    assert torch.equal(received[0][1], expected) and torch.equal(received[1][1], expected * 2)
    validate_schedule([(0, [z12.NAME_Z2])], {z12.NAME_Z2: z12.add_z2_reduce})

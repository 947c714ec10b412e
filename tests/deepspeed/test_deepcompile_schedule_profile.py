"""DeepCompile's profilers (graph_profile, comm_profile) and the selective_gather pass: single-process runs on
plain FX graphs, and 2-rank gloo runs for what must agree across ranks (averaged figures, the failure vote)."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch
from _harness import run_distributed
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule

from deepspeed.compile.passes import selective_gather as sg
from deepspeed.compile.profilers import ProfilingResult, comm_profile
from deepspeed.compile.profilers import graph_profile as gp
from deepspeed.compile.state import DeepCompileState, activate, active_state, release
from deepspeed.compile.util import get_deepcompile_handle

get_deepcompile_handle()
DC = torch.ops.dc
_calls: list[str] = []


def _counted(x: torch.Tensor) -> torch.Tensor:
    _calls.append("counted")
    return x * 2


def _fail_on_rank_1(x: torch.Tensor) -> torch.Tensor:
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
        raise RuntimeError("synthetic out of memory on rank 1")
    return x + 1


def _always_fails(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("synthetic failure")


def _graph(*fns) -> GraphModule:
    g = Graph()
    h = g.placeholder("x")
    for fn in fns:
        h = g.call_function(fn, (h, ))
    g.output(h)
    return GraphModule(torch.nn.Module(), g)


def _meta(gm: GraphModule) -> dict[str, dict]:
    keys = ("device_time", "wall_time", "alloc_mem", "max_mem", "tensor_size")
    return {n.name: {k: n.meta.get(k) for k in keys} for n in gm.graph.nodes}


# ---- graph_profile, one process --------------------------------------------------------------------------------
def test_profiler_times_each_node_and_caches_repeats():
    _calls.clear()
    gm = _graph(_counted, torch.ops.aten.neg.default, _counted)
    x = torch.ones(256)
    out = gp.ProfilingInterpreter(gm, iteration=3, warmup=2).run(x)
    assert torch.equal(out, -x * 4)
    # first _counted: 2 warm-ups + 3 timed runs; the second has other input values but the same key: one run
    assert len(_calls) == 6
    meta = _meta(gm)
    assert not gp.is_profile_incomplete(gm.graph)
    assert meta["_counted"]["tensor_size"] == 256 * 4 and meta["x"]["tensor_size"] == 256 * 4
    assert meta["_counted_1"] == meta["_counted"]  # served from the cache
    assert all(v["device_time"] >= 0 and v["wall_time"] >= 0 for v in meta.values())


def test_profiler_failure_leaves_a_marked_backfilled_profile(capsys):
    gm = _graph(torch.ops.aten.neg.default, _always_fails, torch.ops.aten.neg.default)
    assert gp.ProfilingInterpreter(gm, iteration=1, warmup=0).run(torch.ones(4)) is None
    assert gp.is_profile_incomplete(gm.graph)
    assert all(v["device_time"] is not None for v in _meta(gm).values())  # every key present
    assert "synthetic failure" in capsys.readouterr().out
    handle = get_deepcompile_handle()
    assert not handle.is_profiling()  # switched off again


def test_profiler_refuses_fake_inputs():
    gm = _graph(torch.ops.aten.neg.default)
    with FakeTensorMode():
        fake = torch.ones(2)
    assert gp.ProfilingInterpreter(gm).run(fake) is None
    assert gp.is_profile_incomplete(gm.graph)


def test_profiler_arguments_are_checked():
    with pytest.raises(ValueError, match="iteration >= 1"):
        gp.ProfilingInterpreter(_graph(), iteration=0)


def test_memory_profiler_records_every_node(tmp_path):
    gm = _graph(torch.ops.aten.neg.default, _counted)
    prof = gp.MemoryProfilingInterpreter(gm)
    out = prof.run(torch.ones(8))
    assert torch.equal(out, -torch.ones(8) * 2)
    assert prof.profile_complete
    assert [r[0] for r in prof.mem_record] == [n.name for n in gm.graph.nodes]
    assert all(len(r) == 4 and r[3] >= 0 for r in prof.mem_record)
    prof.dump(tmp_path / "mem.csv")
    rows = list(csv.reader(open(tmp_path / "mem.csv")))
    assert rows[0] == ["node", "memory", "delta", "max_mem"] and len(rows) == len(prof.mem_record) + 1


def test_memory_profiler_failure_empties_the_record():
    prof = gp.MemoryProfilingInterpreter(_graph(torch.ops.aten.neg.default, _always_fails))
    assert prof.run(torch.ones(2)) is None
    assert not prof.profile_complete and prof.mem_record == []


def test_backfill_marks_only_missing_metadata():
    gm = _graph(torch.ops.aten.neg.default)
    for n in gm.graph.nodes:
        n.meta.update(dict.fromkeys(("device_time", "wall_time", "tensor_size", "alloc_mem", "max_mem"), 1))
    gp._backfill_missing_profile_metadata(gm.graph)
    assert not gp.is_profile_incomplete(gm.graph)
    del next(iter(gm.graph.nodes)).meta["max_mem"]
    gp._backfill_missing_profile_metadata(gm.graph)
    assert gp.is_profile_incomplete(gm.graph)
    assert next(iter(gm.graph.nodes)).meta["max_mem"] == 0
    assert not gp.is_profile_incomplete(None)


# ---- graph_profile, two ranks ----------------------------------------------------------------------------------
def _profile_on_ranks(fail: bool):
    gm = _graph(torch.ops.aten.neg.default, _fail_on_rank_1 if fail else torch.ops.aten.exp.default,
                torch.ops.aten.neg.default)
    out = gp.ProfilingInterpreter(gm, iteration=2, warmup=1).run(torch.ones(64))
    mem = gp.MemoryProfilingInterpreter(_graph(torch.ops.aten.neg.default, _fail_on_rank_1))
    mem_out = mem.run(torch.ones(4))
    return (out is None, gp.is_profile_incomplete(gm.graph), _meta(gm), mem_out is None, mem.profile_complete)


def test_ranks_agree_on_averaged_figures():
    results = run_distributed(_profile_on_ranks, world_size=2, args=(False, ), timeout=120)
    (none0, incomplete0, meta0, *_), (none1, incomplete1, meta1, *_) = results
    assert not none0 and not none1 and not incomplete0 and not incomplete1
    assert meta0 == meta1  # one averaged value per node, bitwise the same on both ranks


def test_a_failure_on_one_rank_stops_every_rank_at_the_same_node():
    # rank 1 fails in its second node; rank 0, healthy, must stop there too instead of waiting forever in the
    # third node's collectives; the memory profiler likewise
    for out_none, incomplete, _, mem_none, mem_complete in run_distributed(_profile_on_ranks, world_size=2,
                                                                                args=(True, ), timeout=120):
        assert out_none and incomplete and mem_none and not mem_complete


# ---- comm_profile ----------------------------------------------------------------------------------------------
def test_interpolation_is_piecewise_linear_and_extrapolates():
    predict = comm_profile._interpolate([(0, 0.0), (100, 1.0), (300, 2.0)])
    assert predict(0) == 0.0 and predict(-5) == 0.0
    assert predict(50) == pytest.approx(0.5) and predict(200) == pytest.approx(1.5)
    assert predict(500) == pytest.approx(3.0)


def test_bandwidth_helper_rejects_bad_input():
    with pytest.raises(ValueError, match="duration must be > 0"):
        comm_profile.get_bw("all_gather", 10, 0)


def _measure_all_gather():
    saved = comm_profile.MAX_EXP_HOST, comm_profile.HOST_STOP_SECONDS
    comm_profile.MAX_EXP_HOST = 7
    comm_profile.HOST_STOP_SECONDS = float("inf")  # every size, however loaded the machine (the early stop is timed)
    active_state().comm_profile = None  # measured once per engine's state; this rank's active one measures again
    try:
        predict = comm_profile.create_predictor()
        points = list(comm_profile.profile_results)  # DeepSpeed's module-level name: the active state's points
    finally:  # the worker process is reused by later tests
        comm_profile.MAX_EXP_HOST, comm_profile.HOST_STOP_SECONDS = saved
        active_state().comm_profile = None
    return points, [predict(size) for size, _ in points]


def test_all_gather_cost_model_on_two_ranks():
    (points0, pred0), (points1, _) = run_distributed(_measure_all_gather, world_size=2, timeout=120)
    sizes = [s for s, _ in points0]
    assert sizes == [0] + [2**p // 2 * 2 * 2 for p in range(1, 7)]  # bf16 per-rank elements * 2 bytes * 2 ranks
    assert points0 == points1  # times averaged over ranks
    assert pred0 == pytest.approx([t for _, t in points0])


# ---- selective_gather ------------------------------------------------------------------------------------------
def _param(numel, persist=False):
    return SimpleNamespace(numel=numel, dtype=torch.float32, param=SimpleNamespace(ds_persist=persist, ds_shape=()))


def _allgather_graph(times: dict[int, float]) -> Graph:
    g = Graph()
    for ds_id, t in times.items():
        ag = g.call_function(DC.allgather_param.default, (g.placeholder(f"p{ds_id}"), 0, ds_id))
        ag.meta.update(device_time=t, tensor_size=0)
    g.output(None)
    return g


@pytest.fixture
def persisted(monkeypatch):
    chosen = []
    monkeypatch.setattr(sg, "get_deepcompile_handle", lambda: SimpleNamespace(set_persistent=chosen.append))
    monkeypatch.setattr(sg, "get_accelerator", lambda: SimpleNamespace(total_memory=lambda: 1000,
                                                                       available_memory=lambda: 0))
    return chosen


def test_selective_gather_persists_most_time_per_byte_first(persisted):
    # 900 usable - 700 transient peak = 200 bytes; ids by ms/byte: 3 (0.05), 1 (0.01), 2 (0.005); 4 is persistent
    pm = {0: SimpleNamespace(params={"a": _param(25), "b": _param(25), "c": _param(25), "d": _param(5, True)},
                             ds_ids={"a": 1, "b": 2, "c": 3, "d": 4})}
    prof = ProfilingResult(fwd_graph=_allgather_graph({1: 1.0, 2: 0.5, 3: 5.0, 4: 9.0}), bwd_graph=None,
                           fwd_mem=[("n", 600, 0, 700)], bwd_mem=[("m", 500, 0, 650)])
    for bwd, graph_id in ((False, 0), (True, 1)):  # forward graphs, and backward graphs but the last, do nothing
        sg.selective_gather(None, graph_id, [(0, True), (1, True)], {0: prof}, None, 0.0, pm, bwd=bwd)
    assert persisted == []
    gm = object()
    assert sg.selective_gather(gm, 0, [(0, True), (1, True)], {0: prof}, None, 0.0, pm, bwd=True) is gm
    assert persisted == [3, 1]  # 100 + 100 bytes; 2 would exceed the 200


def test_persistence_budget_without_records():
    assert sg._compute_persistence_budget([[], []], 1000, 0.1) == {
        "usable_mem": 900, "peak_resident_alloc": 0, "transient_peak": 0, "available_mem": 0,
        "profiled_list_count": 0}


# ---- the passes in sequence on real ZeRO-3 parameters, two ranks -----------------------------------------------
def _z3_matmul_graph(params) -> GraphModule:
    """x @ w0 @ w1 @ ... as zero3_compile writes it (gather, wait, use, release), every gather at the top."""
    g = Graph()
    h = g.placeholder("x")
    inputs = [g.placeholder(f"p{i}") for i in range(len(params))]
    waits = []
    for node, p in zip(inputs, params, strict=True):
        ag = g.call_function(DC.allgather_param.default, (node, 0, p.ds_id), {"dtype": torch.float32})
        waits.append(g.call_function(DC.wait_allgather.default, (ag, 0, p.ds_id)))
    for wait, p in zip(waits, params, strict=True):
        h = g.call_function(DC.release_param.default, (g.call_function(torch.matmul, (h, wait)), 0, p.ds_id, 1))
    g.output(h)
    return GraphModule(torch.nn.Module(), g)


def _passes_on_real_parameters():
    from ds_zero.zero3.param import PartitionSpace

    torch.manual_seed(0)
    x, fulls = torch.randn(4, 8), [torch.randn(8, 8) for _ in range(4)]
    expected = x
    for w in fulls:
        expected = expected @ w
    space = PartitionSpace.of(None, "cpu", "cpu")
    params = [torch.nn.Parameter(w.clone()) for w in fulls]
    state = DeepCompileState()  # its own DeepCompile state, as an engine has (the worker process is reused)
    activate(state)
    try:
        return _run_passes(state.handle, x, params, space, expected)
    finally:
        release(state)


def _run_passes(handle, x, params, space, expected):
    from deepspeed.compile.list_schedule import fast_free_schedule
    from deepspeed.compile.passes import offload_parameters, prefetch
    from ds_zero.zero3.convert import convert_param

    for p in params:
        convert_param(p, space)
        handle.register_z3_param(p)
    gm = _z3_matmul_graph(params)
    results = {"plain": torch.equal(gm(x, *params), expected)}

    profile = ProfilingResult(fwd_graph=gm.graph)
    results["profiled"] = torch.equal(gp.ProfilingInterpreter(gm, iteration=2, warmup=1).run(x, *params), expected)
    profile.fwd_tensor_sizes = [(n.name, n.meta["tensor_size"]) for n in gm.graph.nodes]
    gm.graph = fast_free_schedule(gm.graph, 0, 0, debug_log=False)
    mem = gp.MemoryProfilingInterpreter(gm)
    results["scheduled"] = torch.equal(mem.run(x, *params), expected)
    profile.fwd_mem = mem.mem_record
    saved, comm_profile.MAX_EXP_HOST = comm_profile.MAX_EXP_HOST, 6
    try:
        gm = prefetch.schedule_prefetch(gm, 0, [(0, False)], {0: profile}, None, 0.0, None, bwd=False)
    finally:
        comm_profile.MAX_EXP_HOST = saved
    gm = offload_parameters.offload_parameter_fwd(gm, 0, [(0, False)], {}, None, 0.0, None, bwd=False)
    before = handle.gathers
    results["rewritten"] = torch.equal(gm(x, *params), expected)
    results["gathers"] = handle.gathers - before
    results["left_gathered"] = len(handle.gathered)
    results["ops"] = sorted({str(n.target) for n in gm.graph.nodes if str(n.target).startswith("dc.")})
    return results


def test_profile_schedule_prefetch_offload_keep_the_results_on_two_ranks():
    for r in run_distributed(_passes_on_real_parameters, world_size=2, timeout=120):
        assert r["plain"] and r["profiled"] and r["scheduled"] and r["rewritten"]
        assert r["gathers"] == 4  # each parameter gathered once (by its prefetch), then released
        assert r["left_gathered"] == 0
        assert {"dc.prefetch_params_fused.default", "dc.offload_parameter.default",
                "dc.reload_parameter.default"} <= set(r["ops"])

"""DeepCompile's activation offload passes (``offload_activation_floor`` then ``offload_activation``) on a
forward/backward graph pair shaped like a partitioned one, executed: the saved activations the forward hands to
backward are host copies, backward reads them back through ``dc.reload_tensor``, and the results are bitwise those
of the untouched graphs, run after run. The planner keeps resident what the budget has room for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import deepspeed.compile.passes.offload_activation as act

N = 4096


@pytest.fixture(autouse=True)
def _small_tensors_qualify(monkeypatch):
    monkeypatch.setenv(act.MIN_SIZE_ENV, "0")
    monkeypatch.setattr(act, "_h2d_bandwidth", lambda: 10e9)
    yield
    act._offload_plans.clear()
    act.reset_offload_activation_stats()


def _on_device(node, numel=N):
    # the graph's values claim an accelerator (host values are never moved); at run time they are CPU tensors
    node.meta["val"] = torch.empty(numel, device="meta")
    return node


def _graphs():
    fwd = torch.fx.Graph()
    x = _on_device(fwd.placeholder("x"))
    a = _on_device(fwd.call_function(torch.relu, (x, ), name="act_a"))
    b = _on_device(fwd.call_function(torch.sin, (a, ), name="act_b"))
    out = _on_device(fwd.call_function(torch.sum, (b, ), name="out"), 1)
    fwd.output((out, a, b))

    bwd = torch.fx.Graph()
    grad = _on_device(bwd.placeholder("grad"), 1)
    pa, pb = _on_device(bwd.placeholder("act_a")), _on_device(bwd.placeholder("act_b"))
    t = bwd.call_function(torch.cos, (pb, ), name="cos_b")
    t = bwd.call_function(torch.mul, (t, grad), name="scale")
    t = bwd.call_function(torch.mul, (t, pa), name="use_a")
    bwd.output((t, ))
    return torch.fx.GraphModule(torch.nn.Module(), fwd), torch.fx.GraphModule(torch.nn.Module(), bwd)


def _profile(gm, bwd, peak):
    rows = [(n.name, peak, 0, peak) for n in gm.graph.nodes]
    return {0: SimpleNamespace(num_fwd_outputs=1, fwd_mem=[] if bwd else rows, bwd_mem=rows if bwd else [],
                               bwd_time=[(n.name, 1.0, 1.0) for n in gm.graph.nodes] if bwd else [])}


def _apply(pass_fn, gm, bwd, peak=0):
    return pass_fn(gm, 0, [(0, True)], _profile(gm, bwd, peak), lambda: (), 0.0, {}, bwd=bwd)


def _step(fwd, bwd, x):
    out, *saved = fwd(x)
    return out, saved, bwd(torch.ones(()), *saved)[0]


def test_floor_moves_saved_activations_out_and_back_bitwise(monkeypatch):
    monkeypatch.setenv(act.BUDGET_ENV, "1e-9")  # nothing fits: everything moves
    ref_fwd, ref_bwd = _graphs()
    fwd, bwd = _graphs()
    assert _apply(act.offload_activation_floor, fwd, False) is fwd  # returned: the caller profiles the floor
    _apply(act.offload_activation_floor, bwd, True)
    assert act.get_offload_activation_stats()["offload_nodes"] == 2
    assert act.get_offload_activation_stats()["reload_nodes"] == 2
    assert "offload_tensor" in fwd.code and "reload_tensor" in bwd.code

    x = torch.randn(N)
    ref_out, ref_saved, ref_grad = _step(ref_fwd, ref_bwd, x)
    results = []
    for _ in range(3):  # repeated runs: same bits every time
        out, saved, grad = _step(fwd, bwd, x)
        for host, device in zip(saved, ref_saved, strict=True):
            assert torch.equal(host, device)
            # a copy, not the forward's own tensor: what backward gets is the host buffer
            assert host.untyped_storage().data_ptr() != device.untyped_storage().data_ptr()
        assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)
        results.append(grad)
    assert all(torch.equal(r, results[0]) for r in results)


def test_planner_keeps_resident_what_fits_and_drops_its_reload(monkeypatch):
    size = N * 4
    monkeypatch.setenv(act.BUDGET_ENV, str((1000 + size + 1) / 1e9))  # room for one activation above the floor
    monkeypatch.setattr(act, "_get_mem_usage_out_of_torch", lambda: 0)
    monkeypatch.setattr(act, "get_accelerator", lambda: SimpleNamespace(max_memory_allocated=lambda: 0))
    ref_fwd, ref_bwd = _graphs()
    fwd, bwd = _graphs()
    _apply(act.offload_activation_floor, fwd, False)
    _apply(act.offload_activation_floor, bwd, True)
    assert _apply(act.offload_activation, fwd, False, peak=1000) is None  # no replay asked for
    _apply(act.offload_activation, bwd, True)
    moved = [n.name for n in fwd.graph.nodes if n.name.startswith("offload_")]
    reloaded = [n.name for n in bwd.graph.nodes if n.name.startswith("reload_")]
    assert len(moved) == 1 and len(reloaded) == 1
    assert moved[0][len("offload_"):] == reloaded[0][len("reload_"):]
    assert act.get_offload_activation_stats() == {"offload_nodes": 1, "reload_nodes": 1, "planned_offloads": 1}
    x = torch.randn(N)
    for got, want in zip(_step(fwd, bwd, x), _step(ref_fwd, ref_bwd, x), strict=True):
        if isinstance(got, list):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        else:
            assert torch.equal(got, want)


def test_host_values_are_never_candidates(monkeypatch):
    monkeypatch.setenv(act.BUDGET_ENV, "1e-9")
    fwd, _ = _graphs()
    for node in fwd.graph.nodes:
        if node.name.startswith("act_"):
            node.meta["val"] = torch.empty(N)  # a CPU run: nothing to move
    assert _apply(act.offload_activation_floor, fwd, False) is None
    assert not [n for n in fwd.graph.nodes if n.name.startswith("offload_")]


def test_margin_and_budget_inputs_are_checked(monkeypatch):
    monkeypatch.setenv(act.MARGIN_ENV, "a lot")
    with pytest.raises(ValueError, match=act.MARGIN_ENV):
        act._measured_margin(SimpleNamespace(total_memory=lambda: 1))
    monkeypatch.delenv(act.MARGIN_ENV)
    gib = 1024**3
    idle = SimpleNamespace(total_memory=lambda: 100 * gib, memory_reserved=lambda: 0, memory_allocated=lambda: 0)
    fat = SimpleNamespace(total_memory=lambda: 100 * gib, memory_reserved=lambda: 60 * gib,
                          memory_allocated=lambda: 40 * gib)
    assert act._measured_margin(idle) == act.MIN_MEASURED_MARGIN
    assert act._measured_margin(fat) == pytest.approx(0.2)


def _reload_distance(monkeypatch, budget_gb: str, peak: int, node_ms: float) -> int:
    """How many compute nodes run between ``reload_act_a`` and its wait (right before the reader) in a backward
    graph of six small ops followed by the reader, each profiled at ``node_ms`` and ``peak`` bytes."""
    monkeypatch.setenv(act.BUDGET_ENV, budget_gb)
    bwd = torch.fx.Graph()
    grad = _on_device(bwd.placeholder("grad"), 1)
    pa = _on_device(bwd.placeholder("act_a"))
    t = grad
    for i in range(6):
        t = bwd.call_function(torch.relu, (t, ), name=f"work_{i}")
    bwd.output((bwd.call_function(torch.mul, (t, pa), name="use_a"), ))
    gm = torch.fx.GraphModule(torch.nn.Module(), bwd)
    act._offload_plans[0] = {"act_a": (1, N * 4)}
    profile = {0: SimpleNamespace(num_fwd_outputs=1, fwd_mem=[], bwd_mem=[(n.name, peak, 0, peak) for n in bwd.nodes],
                                  bwd_time=[(n.name, node_ms, node_ms) for n in bwd.nodes])}
    act.offload_activation_floor(gm, 0, [(0, True)], profile, lambda: (), 0.0, {}, bwd=True)
    names = [n.name for n in gm.graph.nodes]
    assert names.index("wait_reload_act_a") == names.index("use_a") - 1
    return names.index("use_a") - names.index("reload_act_a") - 2


def test_copy_back_starts_early_enough_to_hide_it(monkeypatch):
    # 16 KiB at 10 GB/s is 1.6 us: one node of 1 us does not cover it, two do
    assert _reload_distance(monkeypatch, "100", peak=0, node_ms=0.001) == 2
    # slower nodes: one is enough
    assert _reload_distance(monkeypatch, "100", peak=0, node_ms=1.0) == 1
    # no room next to the profiled peak: just in time
    assert _reload_distance(monkeypatch, str((1000 + N * 4 - 1) / 1e9), peak=1000, node_ms=0.001) == 0

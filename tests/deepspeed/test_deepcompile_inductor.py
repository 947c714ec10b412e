"""DeepCompile's Inductor lowerings (deepspeed.compile.inductor.register_custom_ops): the dc operators run as
fallback kernels, and Inductor never reuses a buffer whose storage the runtime still holds.

The compiled cases run a tiny post-autograd graph (what DeepCompile hands Inductor's compiler) through
``compile_fx_inner`` with a stand-in handle, so the runtime-owned storage is a tensor the test can inspect.
"""

from __future__ import annotations

import subprocess
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

import deepspeed
from deepspeed.compile import inductor as inductor_mod
from deepspeed.compile.custom_ops import dc_ops


class _Handle:
    """Stand-in for the DeepCompile handle: keeps what the real one keeps (the gathered value, the host copy)."""

    def __init__(self, gathered_factory):
        self.gathered_factory = gathered_factory
        self.gathered: dict[int, torch.Tensor] = {}
        self.offloaded: dict[tuple[int, int], torch.Tensor] = {}
        self.gathered_ref = None
        self.alive_at_release: list[bool] = []

    def param_shape(self, ds_id):
        return torch.Size([16])

    def allgather_param(self, graph_id, ds_id, dtype=None):
        value = self.gathered_factory()
        self.gathered_ref = weakref.ref(value)
        self.gathered[ds_id] = value
        return value

    def release_param(self, graph_id, ds_id, n_users):
        self.gathered.pop(ds_id, None)
        self.alive_at_release.append(self.gathered_ref() is not None)

    def offload_tensor(self, tensor, graph_id, key):
        host = tensor.detach().clone()
        self.offloaded[(graph_id, key)] = host
        return host


@pytest.fixture()
def handle(monkeypatch):
    dc_ops.register()
    inductor_mod.register_custom_ops()
    holder = SimpleNamespace(handle=None)
    monkeypatch.setattr(dc_ops, "_handle", lambda graph_id=None: holder.handle)  # (the graph's engine's handle)
    return holder


def _compile(fn, inputs):
    """``fn`` traced to a post-autograd graph and compiled by Inductor's graph compiler (no AOT autograd: the
    dc operators are inserted after it, as DeepCompile does)."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    compiled = [None]

    def build():
        compiled[0] = compile_fx_inner(gm, list(inputs))

    _, code = run_and_get_code(build)
    return compiled[0], code[0]


def test_runtime_owned_buffers_are_never_overwritten(handle):
    # A gathered value read directly by a pointwise kernel, and a host copy the handle keeps until the backward:
    # both are last read by a kernel of the same size that could write its result in place.
    owned = torch.arange(16, dtype=torch.float32)
    owned_before = owned.clone()
    handle.handle = _Handle(lambda: owned)

    def graph(part, x, act):
        full = torch.ops.dc.allgather_param.default(part, 0, 1)
        y = full * 2 + x
        host = torch.ops.dc.wait_offload.default(torch.ops.dc.offload_tensor.default(act, 0, 7), 0, 7)
        return (host * 3 + y, )

    part, x, act = torch.zeros(4), torch.randn(16), torch.randn(16)
    compiled, _ = _compile(graph, (part, x, act))
    handle.handle = _Handle(lambda: owned)
    (out, ) = compiled([part, x, act])

    assert torch.equal(owned, owned_before), "the compiled graph wrote into the gathered parameter"
    kept = handle.handle.offloaded[(0, 7)]
    assert torch.equal(kept, act), "the compiled graph wrote into the offloaded host copy"
    torch.testing.assert_close(out, act * 3 + owned_before * 2 + x)


def test_gathered_value_read_through_wait_is_freed_before_release(handle):
    # The usual ZeRO-3 shape: allgather -> wait_allgather (a declared alias) -> readers -> release_param. Inductor
    # cannot overwrite that chain, so the lowering leaves it unprotected and the graph drops the gathered value
    # after its last reader: by release_param nothing but the handle held it.
    handle.handle = _Handle(lambda: torch.arange(16, dtype=torch.float32))

    def graph(part, x):
        full = torch.ops.dc.wait_allgather.default(torch.ops.dc.allgather_param.default(part, 0, 1), 0, 1)
        return (torch.ops.dc.release_param.default(full * 2 + x, 0, 1, 1), )

    part, x = torch.zeros(4), torch.randn(16)
    compiled, _ = _compile(graph, (part, x))
    handle.handle = _Handle(lambda: torch.arange(16, dtype=torch.float32))
    (out, ) = compiled([part, x])

    assert handle.handle.alive_at_release == [False]
    torch.testing.assert_close(out, torch.arange(16, dtype=torch.float32) * 2 + x)


def test_every_dc_operator_has_a_reuse_policy():
    assert set(inductor_mod._REUSE_POLICIES) == set(dc_ops._SCHEMAS)
    owned_outputs = {name for name, policy in inductor_mod._REUSE_POLICIES.items() if policy.outputs}
    assert owned_outputs == {"allgather_param", "offload_tensor", "wait_offload", "reload_tensor", "wait_reload"}


def test_register_custom_ops_lowers_each_present_operator(monkeypatch):
    dc_ops.register()
    registered, realized = [], []
    monkeypatch.setattr(inductor_mod, "register_lowering",
                        lambda op, **kw: (lambda fn: registered.append((op, kw, fn)) or fn))
    monkeypatch.setattr(inductor_mod, "add_needs_realized_inputs", realized.append)
    monkeypatch.setattr(inductor_mod, "fallbacks", set())
    # an operator missing from this process's dc library (defined elsewhere with fewer) is skipped, not an error
    monkeypatch.setitem(inductor_mod._REUSE_POLICIES, "not_a_dc_op", inductor_mod.ReusePolicy(outputs=True))

    inductor_mod.register_custom_ops()

    ops = [op for op, _, _ in registered]
    expected = [getattr(torch.ops.dc, name).default for name in inductor_mod._REUSE_POLICIES if name in dc_ops._SCHEMAS]
    assert ops[:len(expected)] == expected
    rng = inductor_mod._get_graphsafe_run_with_rng_state()
    assert ops[len(expected):] == ([rng] if rng is not None else [])
    assert realized == ops and inductor_mod.fallbacks == set(ops)
    assert all(kw == {"type_promotion_kind": None} and fn._is_fallback_handler for _, kw, fn in registered)


def test_graphsafe_rng_outputs_are_never_reused():
    op = inductor_mod._get_graphsafe_run_with_rng_state()
    if op is None:
        pytest.skip("this torch has no graph-safe RNG wrapper")
    calls = []
    assert inductor_mod._register_graphsafe_rng_state_no_reuse(lambda o, **kw: calls.append((o, kw)))
    assert calls == [(op, {"never_reuse_output": True})]


def test_mark_output_never_reuse_marks_only_enabled_buffers():
    class Buffer(inductor_mod.IRNode):

        def __init__(self, name):
            self.name = name

        def get_name(self):
            return self.name

    graph = SimpleNamespace(never_reuse_buffers=set())
    outputs = (Buffer("buf1"), 3, None, [Buffer("buf2")])
    with inductor_mod.V.set_graph_handler(graph):
        assert torch.utils._pytree.tree_map(lambda o: inductor_mod._mark_output_never_reuse(o, enabled=True),
                                            outputs) == outputs
        inductor_mod._mark_output_never_reuse(Buffer("buf3"), enabled=False)
    assert graph.never_reuse_buffers == {"buf1", "buf2"}


def test_importing_the_module_does_not_import_inductor():
    code = ("import sys, deepspeed.compile.backend, deepspeed.compile.inductor as m; "
            "assert 'torch._inductor.lowering' not in sys.modules; m.IRNode; "
            "assert 'torch._inductor.lowering' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _train_zero3(backend: str | None) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}, "compile": {"deepcompile": backend is not None}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    if backend is not None:
        engine.compile(backend=backend)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(2, 8, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"losses": losses, "weights": weights}


def _eager_and_inductor() -> dict:
    return {"eager": _train_zero3(None), "inductor": _train_zero3("inductor")}


def test_zero3_under_inductor_trains_like_eager_zero3():
    # One rank: the gathered value is the partition itself, the case an in-place Inductor kernel would corrupt.
    # Inductor fuses and reorders arithmetic, so the comparison allows rounding, not bitwise equality.
    (result, ) = run_distributed(_eager_and_inductor, world_size=1, timeout=300)
    eager, inductor = result["eager"], result["inductor"]
    assert inductor["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    for a, b in zip(inductor["weights"], eager["weights"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

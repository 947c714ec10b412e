"""DeepCompile's AutoTP pass (``compile: {deepcompile: true, passes: ["autotp"]}``): the compiled graph carries the
tensor-parallel collectives (``torch.ops.autotp``) instead of the layers, and reproduces the module-level AutoTP
run (outputs, parameter gradients and the input gradient) on 2 gloo ranks; the all-or-nothing layer check, the
pass-combination check and the transformers MoE guard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _harness import run_distributed

HIDDEN, INTER = 16, 32


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = torch.nn.Linear(INTER, HIDDEN, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the residual reads x too: only the matmul inputs may be routed through the backward all-reduce
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(HIDDEN, 10, bias=False)  # 10 over 2 ranks: 5 + 5; gather_output joins them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _config(compiled: bool, gather_head: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 0},
              "tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
                  {"patterns": [r".*\.gate_proj\.weight$", r".*\.up_proj\.weight$"], "partition_type": "column"},
                  {"patterns": [r".*\.down_proj\.weight$"], "partition_type": "row"},
                  {"patterns": [r"(.*\.)?head\.weight$"], "partition_type": "column", "gather_output": gather_head},
              ]}}}
    if compiled:
        config["compile"] = {"deepcompile": True, "passes": ["autotp"]}
    return config


def _run(gather_head: bool) -> dict:
    import deepspeed
    from deepspeed.compile.passes.tp_compile import COLUMN_PARALLEL_OP, GATHER_OUTPUT_OP, ROW_PARALLEL_OP

    def build(compiled: bool):
        torch.manual_seed(0)
        model = _Model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(compiled, gather_head))
        return engine

    graphs = []

    def recording_backend(gm, example_inputs):  # ops as packets: a layer's own call is not an overload
        graphs.append([getattr(n.target, "overloadpacket", n.target) for n in gm.graph.nodes
                       if n.op == "call_function"])
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    reference, compiled = build(False), build(True)
    compiled.compile(backend=recording_backend)
    torch.manual_seed(1)
    x = torch.randn(2, 3, HIDDEN, requires_grad=True)
    x_compiled = x.detach().clone().requires_grad_(True)
    out_ref, out_cmp = reference(x), compiled(x_compiled)
    reference.backward(out_ref.square().sum())
    compiled.backward(out_cmp.square().sum())
    grads = [(name, (p.grad - q.grad).abs().max().item())
             for (name, p), (_, q) in zip(reference.module.named_parameters(), compiled.module.named_parameters(),
                                                 strict=True)]
    targets = graphs[0]
    return {"out": (out_ref - out_cmp).abs().max().item(), "width": out_cmp.shape[-1], "grads": grads,
            "x_grad": (x.grad - x_compiled.grad).abs().max().item(),
            "ops": tuple(targets.count(op.overloadpacket) for op in (COLUMN_PARALLEL_OP, ROW_PARALLEL_OP,
                                                                        GATHER_OUTPUT_OP)),
            "deferred": compiled.module.layers[0].down_proj.defer_collectives_to_compiler,
            "graphs": len(graphs)}


@pytest.mark.parametrize("gather_head", [False, True], ids=["sharded-head", "gathered-head"])
def test_compiled_autotp_matches_module_injection(gather_head):
    for result in run_distributed(_run, world_size=2, args=(gather_head, ), timeout=240):
        assert result["graphs"] == 1, "the forward was not captured as one graph"
        assert result["deferred"]
        # one f per shared input (x of each block, the head's input), one g per row layer, the head's gather
        assert result["ops"] == (3, 2, 1 if gather_head else 0)
        assert result["width"] == (10 if gather_head else 5)
        assert result["out"] < 1e-5
        assert result["x_grad"] < 1e-5, "the input gradient differs (a missing or extra backward all-reduce)"
        for name, diff in result["grads"]:
            assert diff < 1e-5, name


def _gather_uneven() -> list:
    import deepspeed.comm as dist
    from deepspeed.compile.custom_ops import tp_collectives
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=2)
    try:
        rank = dist.get_rank()
        width = [2, 3][rank]
        local = (torch.arange(width, dtype=torch.float32) + 10 * rank).repeat(2, 1).requires_grad_(True)
        full = tp_collectives.gather_from_tp_region(local, [2, 3])
        (full * torch.arange(5.0)).sum().backward()
        return [full.tolist(), local.grad.tolist()]
    finally:  # the harness reuses this process: later tests expect no tensor groups
        groups._set_tp_groups(None, None)


def test_gather_from_tp_region_joins_uneven_shards_and_splits_the_gradient():
    for rank, (full, grad) in enumerate(run_distributed(_gather_uneven, world_size=2, timeout=60)):
        assert full == [[0.0, 1.0, 10.0, 11.0, 12.0]] * 2
        assert grad == ([[0.0, 1.0]] * 2 if rank == 0 else [[2.0, 3.0, 4.0]] * 2)


def test_defer_is_all_or_nothing():
    from deepspeed.compile.passes.tp_compile import defer_collectives_to_compiler
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, LmHeadLinearAllreduce

    def layer(cls):
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.mp_group = object()
        return m

    model = torch.nn.Module()
    model.column, model.row = layer(LinearLayer), layer(LinearAllreduce)
    with pytest.raises(NotImplementedError) as err:
        model.head = layer(LmHeadLinearAllreduce)
        defer_collectives_to_compiler(model)
    assert "'head'" in str(err.value) and "LmHeadLinearAllreduce" in str(err.value)
    assert not model.column.defer_collectives_to_compiler and not model.row.defer_collectives_to_compiler
    del model.head
    defer_collectives_to_compiler(model)
    assert model.column.defer_collectives_to_compiler and model.row.defer_collectives_to_compiler


def test_autotp_is_not_combined_with_other_passes():
    from deepspeed.compile.init_tp import check_autotp_passes

    check_autotp_passes(["autotp"])
    check_autotp_passes(["z3"])  # not this check's business
    for other in ("z1", "z3", "autosp"):
        with pytest.raises(NotImplementedError, match=other):
            check_autotp_passes(["autotp", other])


def test_broken_transformers_moe_guard(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from deepspeed.compile.init_tp import BROKEN_TRANSFORMERS_MOE_VERSIONS, _check_broken_transformers_moe

    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts._apply_gate, model.experts.is_concatenated = (lambda x: x), True
    model.experts.config = SimpleNamespace(_experts_implementation="batched_mm")
    first_broken, first_fixed = BROKEN_TRANSFORMERS_MOE_VERSIONS
    monkeypatch.setattr(transformers, "__version__", first_broken)
    with pytest.raises(RuntimeError, match="experts"):
        _check_broken_transformers_moe(model)
    model.experts.config._experts_implementation = "grouped_mm"
    _check_broken_transformers_moe(model)
    model.experts.config._experts_implementation = "batched_mm"
    monkeypatch.setattr(transformers, "__version__", first_fixed)
    _check_broken_transformers_moe(model)

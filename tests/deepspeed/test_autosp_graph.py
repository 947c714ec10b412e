"""DeepSpeed's graph-level AutoSP (deepspeed.compile.init_sp.init_autosp / passes.sp_compile.apply_autosp): the whole,
tagged sequence enters a graph captured with a symbolic length and the graph shards it; on 2 gloo ranks each
rank's loss is the one-process loss over its tokens and the averaged gradients are the one-process gradients. Also
the graph helpers (deepspeed.compile.util: shard_tensor_node, create_shard_offsets, ...) on a captured graph, the
mesh registry (custom_ops.sp_dp_registry) and the torch version check (custom_ops.sp_compat)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import run_distributed

VOCAB, HIDDEN, HEADS, SEQ = 32, 16, 4, 8


class _LM(torch.nn.Module):
    """A causal SDPA language model with Hugging Face's keyword call (input_ids, labels, position_ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Embedding(64, HIDDEN)
        self.qkv, self.proj = torch.nn.Linear(HIDDEN, 3 * HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def logits(self, input_ids, position_ids):
        x = self.embed(input_ids) + self.pos(position_ids)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.proj(attended.transpose(1, 2).reshape(b, s, HIDDEN)))

    def forward(self, input_ids, labels, position_ids):
        return F.cross_entropy(self.logits(input_ids, position_ids).flatten(0, 1), labels.flatten())


def _batch(seq: int):
    gen = torch.Generator().manual_seed(seq)
    ids, labels = (torch.randint(0, VOCAB, (2, seq), generator=gen) for _ in range(2))
    return ids, labels, torch.arange(seq).expand(2, seq).clone()


def _graph_level_training() -> None:
    from deepspeed.compile.init_sp import init_autosp
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _LM()
    captured = []

    def capture(gm, example_inputs):
        captured.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, backend=init_autosp({"sequence_parallel_size": world}, backend=capture),
                             dynamic=True, fullgraph=True)
    graphs = []
    for seq in (SEQ, 2 * SEQ):
        ids, labels, positions = _batch(seq)
        per_token = F.cross_entropy(model.logits(ids, positions).flatten(0, 1), labels.flatten(), reduction="none")
        mine = per_token.view(2, seq)[:, rank * seq // world:(rank + 1) * seq // world].mean()
        model.zero_grad()
        per_token.mean().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        inputs = prepare_autosp_inputs(ids, labels, positions)
        loss = compiled(input_ids=inputs[0], labels=inputs[1], position_ids=inputs[2])
        torch.testing.assert_close(loss, mine, rtol=1e-5, atol=1e-6)
        loss.backward()
        for p, want in zip(model.parameters(), expected, strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad / world, want, rtol=1e-4, atol=1e-6)
        graphs.append(len(captured))
    assert graphs[0] >= 1 and graphs[1] == graphs[0]  # no recompilation: the shard bounds follow the symbol
    (body,) = [m for m in captured[-1].modules() if m is not captured[-1] and isinstance(m, torch.fx.GraphModule)]
    targets = [n.target for n in body.graph.nodes]
    assert targets.count(torch.ops.ds_autosp.all_to_all.default) == 4  # q, k, v and the output
    assert targets.count(operator.getitem) >= 3  # the three tagged inputs are sliced in the graph


def test_graph_level_autosp_on_two_ranks_equals_one_process():
    run_distributed(_graph_level_training, world_size=2, timeout=240)


def _capture(model, ids, labels, positions):
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

    torch._dynamo.reset()
    captured = []

    def keep(gm, example_inputs):
        captured.append(gm)
        return gm

    inputs = prepare_autosp_inputs(ids, labels, positions)
    torch.compile(model, backend=keep, dynamic=True)(input_ids=inputs[0], labels=inputs[1], position_ids=inputs[2])
    return captured[0]


def _helpers() -> None:
    from deepspeed.compile.custom_ops import sp_dp_registry
    from deepspeed.compile.util import (
        create_shard_offsets,
        get_input_id_node,
        get_label_id_node,
        get_position_id_node,
        get_sdpa_nodes,
        shard_tensor_node,
    )

    rank = dist.get_rank()
    sp_dp_registry.populate_registry(2, 1)
    assert sp_dp_registry.is_setup() and sp_dp_registry.sp_size() == 2 and sp_dp_registry.dp_size() == 1
    assert dist.get_world_size(sp_dp_registry.get_group(0)) == 2
    sp_dp_registry.populate_registry(1, 2)  # built once: later calls keep the first mesh
    assert sp_dp_registry.sp_size() == 2
    with pytest.raises(KeyError, match="no sequence-parallel group 5"):
        sp_dp_registry.get_group(5)

    torch.manual_seed(0)
    model = _LM()
    ids, labels, positions = _batch(SEQ)
    gm = _capture(model, ids, labels, positions)
    assert len(get_sdpa_nodes(gm)) == 1
    nodes = [get_input_id_node(gm), get_label_id_node(gm), get_position_id_node(gm)]
    assert all(n.op == "placeholder" for n in nodes)
    start, end = create_shard_offsets(gm, next(iter(gm.graph.find_nodes(op="placeholder"))))
    assert start.target is operator.mul and start.args[0] == rank and end.args == (start, start.args[1])
    # slicing the tagged inputs in the graph = running the function on this rank's slice
    weight = model.embed.weight.detach()

    def embed_only(input_ids, labels, position_ids):
        return F.embedding(input_ids, weight) + position_ids[..., None]

    gm = _capture(embed_only, ids, labels, positions)
    sliced = [shard_tensor_node(gm, get_input_id_node(gm)), shard_tensor_node(gm, get_position_id_node(gm))]
    gm.graph.lint()
    gm.recompile()
    assert all(n.target is operator.getitem for n in sliced)
    real = {"input_ids": ids, "position_ids": positions, "labels": labels, "weight": weight}
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):  # Dynamo's inputs: length symbols and tensors
        value = node.meta["example_value"]
        if isinstance(value, torch.SymInt):
            values.append(value.node.hint)
        else:
            values.append(next(t for name, t in real.items() if name in node.name))
    (out,) = gm(*values)
    rows = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    torch.testing.assert_close(out, F.embedding(ids[:, rows], weight) + positions[:, rows, None])


def test_graph_helpers_and_mesh_registry():
    run_distributed(_helpers, world_size=2, timeout=120)


def test_torch_version_check():
    from deepspeed.compile.custom_ops.sp_compat import check_autosp_compatibility

    check_autosp_compatibility("2.9.0+cu128")
    check_autosp_compatibility("2.10.1")
    with pytest.raises(RuntimeError, match="PyTorch >= 2.9, found 2.8.0"):
        check_autosp_compatibility("2.8.0")
    with pytest.raises(ValueError, match="cannot read"):
        check_autosp_compatibility("nightly")

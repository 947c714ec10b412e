"""AutoSP (``compile: {deepcompile: true, passes: ["autosp"]}``, spec 2.1.10): a tiny SDPA language model compiled
through the AutoSP pass trains on 2 ranks, each holding half of every sequence, exactly as the plain model trains
on the whole sequence in one process; its memory optimization (selective activation checkpointing) saves fewer
activations for the same gradients; the pass's misuse cases are clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import run_distributed

VOCAB, HIDDEN, HEADS, SEQ, BATCH, STEPS, LR = 32, 16, 4, 8, 2, 3, 0.5
TOL = dict(rtol=1e-5, atol=1e-5)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = torch.nn.Linear(HIDDEN, 3 * HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                       torch.nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        if mask is None:  # the causal flag instead of a mask (what Hugging Face passes without padding)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, HIDDEN))
        return x + self.mlp(x)


class _TinyLM(torch.nn.Module):
    """Takes the batch as ``prepare_autosp_inputs`` returns it; the causal-and-padding mask is built from the
    position ids (query rows: this rank's shard under AutoSP) and the whole padding mask (keys)."""

    def __init__(self, graph_break: bool = False, causal_flag: bool = False, cache_mask: bool = False) -> None:
        super().__init__()
        self.causal_flag, self.cache_mask = causal_flag, cache_mask
        self.embed, self.pos = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Embedding(SEQ, HIDDEN)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.graph_break = graph_break

    def forward(self, batch):
        input_ids, labels, position_ids, padding = batch
        keys = torch.arange(padding.shape[1], device=padding.device)
        # cache_mask: query rows from arange(the input's length), as Hugging Face's cache positions: AutoSP keeps
        # them whole (computed from the length symbol, not from the sharded inputs)
        cache = torch.arange(input_ids.shape[1], device=input_ids.device)
        rows = cache[None, :].expand(position_ids.shape[0], -1) if self.cache_mask else position_ids
        mask = None if self.causal_flag else (rows[:, None, :, None] >= keys) & padding[:, None, None, :].bool()
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
            if self.graph_break:
                torch._dynamo.graph_break()
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _batches():
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        padding = torch.ones(BATCH, SEQ, dtype=torch.long)
        padding[1, :2] = 0  # left padding in the second sample
        yield ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.arange(SEQ).expand(BATCH, SEQ), padding


def _reference():
    torch.manual_seed(0)
    model = _TinyLM()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in _batches():
        opt.zero_grad()
        loss = model(batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), initial


def _config(sp: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**6, "sequence_parallel_size": sp,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 0},
            "compile": {"deepcompile": True, "passes": ["autosp"]}, **extra}


def _autosp_training(backend: str, stage: int = 0, cache_mask: bool = False) -> list[float]:
    import deepspeed
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

    expected, final, initial = _reference()
    model = _TinyLM(cache_mask=cache_mask)
    model.load_state_dict(initial)
    config = _config(dist.get_world_size(), zero_optimization={"stage": stage}, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.compile(backend=backend)
    got = []
    for ids, labels, positions, padding in _batches():
        loss = engine(prepare_autosp_inputs(input_id=ids, label_id=labels, position_id=positions,
                                            attention_mask=padding, seq_dim=1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # each rank's loss is its shard's mean; the shards are equal
        got.append(mean.item() / dist.get_world_size())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **TOL)
    for name, p in engine.module.named_parameters():
        torch.testing.assert_close(p, final[name], **TOL, msg=name)
    return got


def test_compiled_model_on_two_ranks_trains_like_one_process():
    # aot_eager: AOT autograd traces the backward through the all-to-all op, as Inductor does (Inductor itself
    # only adds C++ compilation time; benchmarks/autosp.py runs it)
    losses = run_distributed(_autosp_training, world_size=2, args=("aot_eager",), timeout=180)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]


def test_mask_built_from_the_whole_length_trains_like_one_process():
    # Hugging Face's layout: the mask's query rows come from arange(seq), not from the sharded inputs, so the graph
    # keeps them whole, as the all-to-all layout needs
    losses = run_distributed(_autosp_training, world_size=2, args=("eager", 0, True), timeout=180)
    assert losses[0] == losses[1]


def test_autosp_with_zero_stage_1_trains_like_one_process():
    # ZeRO-1 partitions the optimizer state over both ranks and averages the shard losses' gradients over them
    losses = run_distributed(_autosp_training, world_size=2, args=("eager", 1), timeout=180)
    assert losses[0] == losses[1]


def _one_step_saving(enabled: bool) -> tuple:
    """One AutoSP step (aot_eager) with the memory optimization on or off: loss, averaged gradients and the
    activations the compiled forward saved for backward (parameters left out) as ``{storage: (bytes, shape)}``."""
    import deepspeed
    from deepspeed.compile.passes import long_context_checkpointing
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

    long_context_checkpointing.enabled = enabled
    try:
        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=_TinyLM(), config=_config(2))
        engine.compile(backend="aot_eager")
    finally:
        long_context_checkpointing.enabled = True
    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(prepare_autosp_inputs(*next(_batches())))
    engine.backward(loss)
    return loss.detach(), [p.grad.clone() for p in engine.module.parameters()], saved


def _memory_optimization() -> None:
    loss_off, grads_off, saved_off = _one_step_saving(False)
    loss_on, grads_on, saved_on = _one_step_saving(True)
    torch.testing.assert_close(loss_on, loss_off, rtol=0, atol=0)
    for on, off in zip(grads_on, grads_off, strict=True):
        torch.testing.assert_close(on, off, **TOL)
    bytes_on, bytes_off = (sum(b for b, _ in saved.values()) for saved in (saved_on, saved_off))
    assert bytes_on < 0.6 * bytes_off, (bytes_on, bytes_off)
    shapes_on, shapes_off = ({shape for _, shape in saved.values()} for saved in (saved_on, saved_off))
    attention_out = (BATCH, HEADS // 2, SEQ, HIDDEN // HEADS)  # Ulysses layout: half the heads, whole sequence
    assert attention_out in shapes_on and attention_out in shapes_off  # attention is kept
    mlp_matmul = (BATCH * SEQ // 2, 2 * HIDDEN)  # the first MLP matmul's output on a shard
    assert mlp_matmul in shapes_off and mlp_matmul not in shapes_on  # matmuls are recomputed


def test_memory_optimization_recomputes_matmuls_keeps_attention_and_gives_the_same_gradients():
    run_distributed(_memory_optimization, world_size=2, timeout=120)


def _pass_inserts_all_to_all() -> int:
    """The graph handed to the inner backend: one exchange per q/k/v/output of each SDPA, one mask gather each."""
    import deepspeed
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

    seen = []

    def inspect(gm, example_inputs):  # the captured graph is the body of AutoSP's selective checkpoint
        assert [str(n.target) for n in gm.graph.nodes if n.op == "call_function"][0] == "tag_activation_checkpoint"
        seen.append([str(n.target) for n in gm.autosp_body.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=_TinyLM(), config=_config(2))
    engine.compile(backend=inspect)
    ids, labels, positions, padding = next(_batches())
    engine(prepare_autosp_inputs(ids, labels, positions, padding))
    (targets,) = seen
    assert targets.count("ds_autosp.all_to_all.default") == 2 * 4
    assert targets.count("ds_autosp.all_gather.default") == 2  # the mask rows (built from sharded positions)

    torch.manual_seed(0)  # is_causal=True and no mask: the same loss as the whole sequence in one process
    model = _TinyLM(causal_flag=True)
    expected = model((ids, labels, positions, padding))
    engine, *_ = deepspeed.initialize(model=model, config=_config(2))
    engine.compile(backend="eager")
    loss = engine(prepare_autosp_inputs(*(t.clone() for t in (ids, labels, positions, padding)))).detach()
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / 2, expected, **TOL)
    return len(targets)


def test_pass_wraps_every_attention_in_all_to_alls():
    run_distributed(_pass_inserts_all_to_all, world_size=2, timeout=120)


def _misuse() -> None:
    import deepspeed
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

    ids, labels, positions, padding = next(_batches())
    engine, *_ = deepspeed.initialize(model=_TinyLM(graph_break=True), config=_config(2))
    engine.compile(backend="eager")
    with pytest.raises(RuntimeError, match="graph break"):
        engine(prepare_autosp_inputs(ids, labels, positions, padding))
    engine, *_ = deepspeed.initialize(model=_TinyLM(), config=_config(2))
    engine.compile(backend="eager")
    with pytest.raises(ValueError, match="no input marked for sequence sharding"):
        engine(tuple(t.clone() for t in (ids, labels, positions, padding)))  # clones carry no AutoSP tag
    odd = [t[:, :7] for t in (ids, labels, positions, padding)]
    with pytest.raises(ValueError, match=r"sequence length \(7, dim 1\) must be divisible by"):
        engine(prepare_autosp_inputs(*odd))

    class _NoSdpa(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)

        def forward(self, batch):
            return self.lin(batch[0].float().unsqueeze(-1)).mean()

    engine, *_ = deepspeed.initialize(model=_NoSdpa(), config=_config(2))
    engine.compile(backend="eager")
    with pytest.raises(Exception, match="no torch.nn.functional.scaled_dot_product_attention"):
        engine(prepare_autosp_inputs(ids, labels))
    with pytest.raises(ValueError, match="schedule"):
        engine.compile(schedule=[(0, ["z1"])])
    _config_errors()


def _config_errors() -> None:
    import deepspeed
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs
    from ds_config import ConfigError

    with pytest.raises(ConfigError, match="ZeRO stage 0 or 1"):
        deepspeed.initialize(model=_TinyLM(), config=_config(1, zero_optimization={"stage": 2}))
    bad_pass = _config(1)
    bad_pass["compile"]["passes"] = ["autosp", "z1"]
    with pytest.raises(ConfigError, match=r"compile\.passes.*AutoSP"):
        deepspeed.initialize(model=_TinyLM(), config=bad_pass)
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="label_id is required"):
        prepare_autosp_inputs(ids, None)
    with pytest.raises(ValueError, match="seq_dim=2 is not a dimension of input_id"):
        prepare_autosp_inputs(ids, ids, seq_dim=2)
    with pytest.raises(ValueError, match="position_id has 4 positions"):
        prepare_autosp_inputs(ids, ids, position_id=ids[:, :4])
    marked = prepare_autosp_inputs(ids, ids.clone(), ids.clone())
    assert [t.tag for t in marked[:3]] == ["input_id", "label_id", "position_id"]  # DeepSpeed's tags
    assert [t.autosp_seq_dim for t in marked[:3]] == [1, 1, 1]


def test_graph_breaks_missing_sdpa_unmarked_inputs_and_bad_configs_are_clear_errors():
    run_distributed(_misuse, world_size=2, timeout=120)

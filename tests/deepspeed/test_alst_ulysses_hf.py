"""ALST's Ulysses for Hugging Face models on 2 gloo ranks: UlyssesSPAttentionHF.register_with_transformers and
UlyssesSPDataLoaderAdapter (deepspeed.runtime.sequence_parallel.ulysses_sp).

A tiny random Llama (no download) runs once on the full sequence on one rank (the reference) and once sequence-
parallel, each rank holding half of the sequence. Tolerance rtol=1e-5, atol=1e-6 (fp32): the attention is the same
math per head, but projections over half the rows may take another BLAS blocking and the parameter gradients are
sums over ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _harness import distributed_test

pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-6}
SEQ, BS = 16, 2


def _tiny_llama(kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _shift(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]


def _loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")


class _Registered:
    """register_with_transformers mutates process state (the mpu module's groups, Transformers' attention table);
    the harness reuses worker processes, so undo both on exit."""

    def __init__(self, model, **kwargs) -> None:
        self.model, self.kwargs = model, kwargs

    def __enter__(self):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        self.saved = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return UlyssesSPAttentionHF.register_with_transformers(self.model, "sdpa", 2, BS, **self.kwargs)

    def __exit__(self, *exc) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
        ALL_ATTENTION_FUNCTIONS["sdpa"] = self.saved
        mpu._SEQUENCE_PARALLEL_GROUP = mpu._SEQUENCE_DATA_PARALLEL_GROUP = None


@distributed_test(world_size=[2])
@pytest.mark.parametrize("kv_heads", [2, 1])  # 1 < 2 ranks: the key/value head is replicated
@pytest.mark.parametrize("variable", [True, False])
def test_sp_attention_equals_full_sequence(kv_heads: int, variable: bool) -> None:
    rank = dist.get_rank()
    torch.manual_seed(1)  # the same batch on both ranks
    ids = torch.randint(0, 64, (BS, SEQ))
    pos = torch.arange(SEQ).expand(BS, SEQ).contiguous()
    shift = _shift(ids)
    count = (shift != -100).sum()

    ref_model = _tiny_llama(kv_heads)
    sp_model = copy.deepcopy(ref_model)
    ref_logits = ref_model(input_ids=ids, position_ids=pos).logits
    (_loss_sum(ref_logits, shift) / count).backward()

    mine = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    with _Registered(sp_model, seq_length=SEQ, seq_length_is_variable=variable) as mpu:
        assert mpu.get_sequence_parallel_world_size() == 2
        logits = sp_model(input_ids=ids[:, mine], position_ids=pos[:, mine]).logits
        (_loss_sum(logits, shift[:, mine]) / count).backward()
    torch.testing.assert_close(logits, ref_logits[:, mine].detach(), **TOL)
    for (name, p), q in zip(sp_model.named_parameters(), ref_model.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each rank holds the gradient of its half of the loss
        torch.testing.assert_close(grad, q.grad, **TOL, msg=name)


@distributed_test(world_size=[2])
def test_sp_attention_errors() -> None:
    model = _tiny_llama(2)
    with _Registered(model, seq_length=SEQ, seq_length_is_variable=False):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        q = torch.zeros(BS, 4, SEQ // 2, 8)
        with pytest.raises(ValueError, match="every forward needs position_ids"):  # (models pass their own)
            ALL_ATTENTION_FUNCTIONS["sdpa"](model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None)
        with pytest.raises(ValueError, match=r"expected query \(2, 4, 8, 8\)"):
            model(input_ids=torch.zeros(BS, 4, dtype=torch.long), position_ids=torch.arange(4).expand(BS, 4))
    mismatch = "core_attn_implementation='eager' does not match model config attn_implementation='sdpa'"
    with pytest.raises(ValueError, match=mismatch):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        UlyssesSPAttentionHF.register_with_transformers(model, "eager", 2, BS)


def _rank_batches(rank: int) -> list[dict]:
    """Rank r's own loader: 2 batches of different lengths, ids distinct per rank."""
    out = []
    for i, seq in enumerate((6, 8)):
        ids = torch.arange(seq).expand(1, seq) + 100 * rank + 10 * i
        out.append({"input_ids": ids, "position_ids": torch.arange(seq).expand(1, seq), "labels": ids + 1000,
                    "tag": f"r{rank}b{i}"})
    return out


@distributed_test(world_size=[2])
def test_dataloader_adapter_shards_each_batch() -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    rank, group = dist.get_rank(), dist.group.WORLD
    loader = _rank_batches(rank)
    adapter = UlyssesSPDataLoaderAdapter(loader, sp_rank=rank, sp_group=group, sp_world_size=2, device="cpu")
    assert len(adapter) == 4
    for epoch in range(2):  # a second pass restarts the wrapped loader
        got = list(adapter)
        assert len(got) == 4, epoch
        # order: batch i of rank 0, of rank 1, then batch i + 1 of both
        sources = [(i, r) for i in range(2) for r in range(2)]
        for micro, (i, r) in zip(got, sources, strict=True):
            original = _rank_batches(r)[i]
            assert micro["tag"] == original["tag"] and "labels" not in micro
            halves: list = [None, None]
            dist.all_gather_object(halves, {k: micro[k] for k in ("input_ids", "position_ids", "shift_labels")})
            for key, want in (("input_ids", original["input_ids"]), ("position_ids", original["position_ids"]),
                              ("shift_labels", _shift(original["labels"]))):
                assert torch.equal(torch.cat([h[key] for h in halves], dim=1), want), key


@distributed_test(world_size=[2])
def test_dataloader_adapter_errors_reach_every_rank() -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    rank = dist.get_rank()
    batch = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "labels": torch.zeros(1, 6, dtype=torch.long)}
    if rank == 0:
        batch["position_ids"] = torch.arange(6).expand(1, 6)
    adapter = UlyssesSPDataLoaderAdapter([batch], rank, dist.group.WORLD, 2, "cpu")
    with pytest.raises(ValueError, match="sequence-parallel rank 1: 'position_ids' is missing"):
        next(adapter)
    odd = {"input_ids": torch.zeros(1, 5, dtype=torch.long), "labels": torch.zeros(1, 5, dtype=torch.long),
           "position_ids": torch.arange(5).expand(1, 5)}
    with pytest.raises(ValueError, match=r"sequence length \(5\) is not divisible"):
        next(UlyssesSPDataLoaderAdapter([odd], rank, dist.group.WORLD, 2, "cpu"))
    good = dict(odd, input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long),
                position_ids=torch.arange(4).expand(1, 4))
    uneven = UlyssesSPDataLoaderAdapter([good] * (1 + rank), rank, dist.group.WORLD, 2, "cpu")
    next(uneven), next(uneven)  # the first refill: one batch from each rank
    with pytest.raises(RuntimeError, match=r"sequence-parallel ranks \[0\] ran out"):
        next(uneven)


@distributed_test(world_size=[2])
def test_disable_in_eval_attends_locally() -> None:
    """disable_in_eval: a module in eval mode skips the exchange, so each rank runs the full sequence itself."""
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (BS, SEQ))
    pos = torch.arange(SEQ).expand(BS, SEQ)
    model = _tiny_llama(2).eval()
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos).logits
        with _Registered(model, disable_in_eval=True):
            got = model(input_ids=ids, position_ids=pos).logits
            model.train()
            sharded = model(input_ids=ids[:, :SEQ // 2], position_ids=pos[:, :SEQ // 2]).logits  # SP again
    assert torch.equal(got, ref)
    assert sharded.shape == (BS, SEQ // 2, 64)


@distributed_test(world_size=[2])
@pytest.mark.parametrize("stage", [2, 3])
def test_engine_sp_gradients_equal_data_parallel(stage: int) -> None:
    """DeepSpeed's recipe end to end: deepspeed.initialize with the returned mpu, the adapter feeding the engine, the
    loss divided by the group's counted tokens; the gradient equals a plain engine's on the whole batch."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups, safe_get_full_grad
    config = {"train_micro_batch_size_per_gpu": BS, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (BS, SEQ))
    batch = {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(BS, SEQ), "labels": ids.clone()}
    base = _tiny_llama(2)
    sp_model = copy.deepcopy(base)
    engine_a, *_ = deepspeed.initialize(model=base, config=config)
    engine_a.backward(engine_a(**batch).loss)  # both ranks hold the same batch: the average is its gradient
    want = {n: safe_get_full_grad(p).clone() for n, p in engine_a.module.named_parameters()}

    with _Registered(sp_model, seq_length=SEQ, seq_length_is_variable=True) as mpu:
        engine_b, *_ = deepspeed.initialize(model=sp_model, config=dict(config, sequence_parallel_size=2), mpu=mpu)
        group = groups._get_sequence_parallel_group()
        adapter = UlyssesSPDataLoaderAdapter([batch], groups._get_sequence_parallel_rank(), group,
                                             groups._get_sequence_parallel_world_size(), "cpu")
        micro = next(adapter)
        shift = micro.pop("shift_labels")
        logits = engine_b(**micro).logits
        counted = (shift != -100).sum()
        dist.all_reduce(counted, group=group)
        # this rank's share of the mean loss: the engine sums sequence ranks' gradients, as DeepSpeed does (a
        # loss made global with a differentiable all-gather, as in DeepSpeed's test, backpropagates P times it)
        engine_b.backward(_loss_sum(logits, shift) / counted)
        got = {n: safe_get_full_grad(p).clone() for n, p in engine_b.module.named_parameters()}
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, **TOL, msg=name)

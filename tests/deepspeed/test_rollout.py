"""deepspeed.runtime.rollout: the rollout interface and HybridEngineRollout (generation with the trained weights).

References: Hugging Face ``generate`` on the same tiny model (greedy: same tokens; sampling: same tokens under
the same seed) and, under ZeRO-3 on 2 gloo ranks, the single-process model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _harness import run_distributed

from deepspeed.runtime.rollout import (
    HybridEngineRollout,
    RolloutBatch,
    RolloutConfig,
    RolloutRequest,
    SamplingConfig,
    build_rollout,
)
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

PROMPTS = torch.tensor([[0, 0, 5, 9, 7], [3, 4, 5, 6, 7], [0, 8, 1, 3, 3]])
MASK = (PROMPTS != 0).long()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(config)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                        pad_token_id=0, eos_token_id=2, bos_token_id=1))


def _rollout(model: torch.nn.Module, eos: int | None = 2, graph: bool = False) -> HybridEngineRollout:
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=eos)
    return HybridEngineRollout(SimpleNamespace(module=model), tokenizer, HybridEngineRolloutConfig(graph))


def _reference(model: torch.nn.Module, eos: int | None, prompts: torch.Tensor = PROMPTS, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.eval().generate(prompts, attention_mask=(prompts != 0).long(), max_new_tokens=8,
                                     pad_token_id=0, eos_token_id=eos, **kwargs)


@pytest.mark.parametrize("make", [_gpt2, _llama])
@pytest.mark.parametrize("graph", [False, True])
def test_greedy_rollout_is_generate(make, graph: bool) -> None:
    model = make()
    free = _reference(model, eos=None)
    # an EOS id the first row emits mid-response: that row stops there and is padded, the others go on
    eos = int(free[0, PROMPTS.shape[1] + 2])
    want = _reference(model, eos=eos)
    model.train()
    out = _rollout(model, eos=eos, graph=graph).generate(RolloutRequest(PROMPTS, MASK),
                                                         SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert model.training  # back in its mode after generation
    assert torch.equal(out.input_ids, want)
    assert out.response_start_idx.tolist() == [5, 5, 5]
    response_mask = out.attention_mask[:, 5:]
    first_eos = int((want[0, 5:] == eos).nonzero()[0])
    assert response_mask[0].tolist() == [1] * (first_eos + 1) + [0] * (want.shape[1] - 6 - first_eos)
    assert torch.equal(out.attention_mask[:, :5], MASK)


def test_graph_decode_stops_when_every_row_finished() -> None:
    model = _gpt2()
    free = _reference(model, eos=None, prompts=PROMPTS[1:2])
    eos = int(free[0, 6])  # the second generated token of the only row
    out = _rollout(model, eos=eos, graph=True).generate(RolloutRequest(PROMPTS[1:2], MASK[1:2]),
                                                        SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert torch.equal(out.input_ids, _reference(model, eos=eos, prompts=PROMPTS[1:2]))
    assert out.seq_len < 5 + 8 and out.attention_mask[0, 5:].tolist() == [1] * (out.seq_len - 5)


def test_sampling_is_generate_under_the_same_seed_with_n_samples() -> None:
    model = _gpt2()
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=5, n_samples_per_prompt=2)
    torch.manual_seed(123)
    out = _rollout(model).generate(RolloutRequest(PROMPTS, MASK), sampling)
    assert model.training  # the rollout sampled in eval mode and put the training mode back
    torch.manual_seed(123)
    with torch.no_grad():
        want = model.eval().generate(PROMPTS.repeat_interleave(2, 0), attention_mask=MASK.repeat_interleave(2, 0),
                              max_new_tokens=6, pad_token_id=0, do_sample=True, temperature=0.7, top_p=0.9, top_k=5)
    assert out.batch_size == 6 and torch.equal(out.input_ids, want)
    assert torch.equal(out.input_ids[0::2, :5], PROMPTS) and torch.equal(out.input_ids[1::2, :5], PROMPTS)


def test_sample_top_p_keeps_the_nucleus_only() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(4000, 3)
    drawn = HybridEngineRollout._sample_top_p(logits, temperature=1.0, top_p=0.6).flatten()
    counts = torch.bincount(drawn, minlength=3)
    assert counts[2] == 0  # 0.5 + 0.3 already reach 0.6
    assert abs(counts[0].item() / 4000 - 0.625) < 0.03  # renormalised over the nucleus: 0.5 / 0.8
    with pytest.raises(ValueError, match="temperature must be > 0"):
        HybridEngineRollout._sample_top_p(logits, temperature=0.0)


def test_interface_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingConfig(max_new_tokens=1, top_p=1.5)
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        SamplingConfig(max_new_tokens=1, n_samples_per_prompt=0)
    with pytest.raises(ValueError, match="prompt_attention_mask shape"):
        RolloutRequest(PROMPTS, MASK[:, :4])
    with pytest.raises(ValueError, match="response_start_idx must be 1-D of length 3"):
        RolloutBatch(PROMPTS, MASK, torch.tensor([5, 5]))
    with pytest.raises(ValueError, match="tokenizer has neither"):
        HybridEngineRollout(SimpleNamespace(module=_gpt2()), SimpleNamespace(pad_token_id=None, eos_token_id=None)
                            ).generate(RolloutRequest(PROMPTS, MASK), SamplingConfig(max_new_tokens=1))


def test_build_rollout() -> None:
    engine, tokenizer = SimpleNamespace(module=None), SimpleNamespace(pad_token_id=0)
    rollout = build_rollout(RolloutConfig(use_graph_capture=True), student_engine=engine, tokenizer=tokenizer)
    assert isinstance(rollout, HybridEngineRollout) and rollout.use_graph_capture and rollout.engine is engine
    assert rollout.sync_weights(3) is None
    with pytest.raises(ValueError, match="Unknown rollout engine 'vllm'"):
        build_rollout(RolloutConfig(engine="vllm"))
    with pytest.raises(ValueError, match="needs both"):
        build_rollout(RolloutConfig(), student_engine=engine)


def _zero3_body(graph: bool) -> dict:
    import deepspeed

    model = _gpt2()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "hybrid_engine": {"enabled": True},
        "steps_per_print": 1000})
    rollout = build_rollout(RolloutConfig(use_graph_capture=graph), engine, SimpleNamespace(pad_token_id=0,
                                                                                             eos_token_id=2))
    out = rollout.generate(RolloutRequest(PROMPTS, MASK), SamplingConfig(max_new_tokens=8, temperature=0.0))
    partitioned = {p.ds_status.name for p in engine.module.parameters()}
    loss = engine(input_ids=out.input_ids, attention_mask=out.attention_mask, labels=out.input_ids).loss
    engine.backward(loss)
    engine.step()
    return {"tokens": out.input_ids.tolist(), "after": sorted(partitioned), "loss": float(loss)}


@pytest.mark.parametrize("graph", [False, True])
def test_zero3_hybrid_engine_rollout_then_train(graph: bool) -> None:
    want = _reference(_gpt2(), eos=2).tolist()
    for out in run_distributed(_zero3_body, world_size=2, args=(graph, ), timeout=180):
        assert out["tokens"] == want
        assert out["after"] == ["NOT_AVAILABLE"]  # the gathered weights were released after generation
        assert out["loss"] > 0

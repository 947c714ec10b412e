"""Real Hugging Face models (transformers, a test-only dependency) against torch.utils.flop_counter.

Tiny GPT-2 / BERT built from config objects with random weights (no download: HF_HUB_OFFLINE=1), called as HF
users call them (keyword arguments, attention masks, ``generate()``). The matmul family must agree exactly
with FlopCounterMode (our FLOPs for it are 2 x MACs, its convention too).

Conventions that differ from FlopCounterMode (so the comparisons below are on MACs, not total FLOPs):
- FlopCounterMode counts only matmul/conv/attention ops; we also count normalizations, softmax,
  activations, elementwise arithmetic and reductions, so our total FLOPs are larger.
- ``aten._scaled_dot_product_flash_attention_for_cpu`` (the CPU sdpa kernel HF's ``attn_implementation=
  "sdpa"`` reaches) has no FlopCounterMode formula, so FlopCounterMode counts 0 for it; we count the two
  matmuls (B*H*Sq*Sk*(D + Dv) MACs, the same as the eager path's two bmm) plus the softmax, mask and scaling.
  The sdpa path is therefore checked against an analytic count instead.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ds_profiler import FlopsProfiler, get_model_profile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub: models are built from configs
import transformers  # noqa: E402 - a declared test dependency (hatch.toml): its absence must fail, not skip

DIM, LAYERS, HEADS, SEQ, BATCH, VOCAB, FFN = 64, 2, 4, 16, 2, 128, 256


def gpt2(attn: str):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=DIM, n_layer=LAYERS, n_head=HEADS,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def bert(attn: str):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
                                     attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def batch() -> dict[str, torch.Tensor]:
    """HF-style keyword inputs; the second row is padded so the attention mask matters."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 6:] = 0
    return {"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator), "attention_mask": mask}


def reference_flops(call) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        call()
    return counter.get_total_flops()


def profiled(model, call) -> FlopsProfiler:
    prof = FlopsProfiler(model)
    prof.start_profile()
    try:
        with torch.no_grad():
            call()
    finally:
        prof.stop_profile()
    return prof


def linear_macs(model) -> int:
    """Analytic MACs of the dense layers (HF's Conv1D / nn.Linear) for one forward of ``batch()``."""
    tokens = BATCH * SEQ
    if isinstance(model, transformers.GPT2LMHeadModel):
        # Per layer c_attn D->3D, attn c_proj D->D, c_fc D->4D, mlp c_proj 4D->D; then the tied LM head D->V.
        return tokens * (LAYERS * (3 * DIM * DIM + DIM * DIM + 4 * DIM * DIM + 4 * DIM * DIM) + DIM * VOCAB)
    # Per layer query/key/value D->D each, attention output D->D, intermediate D->FFN, output FFN->D; the
    # pooler (D->D) runs on the first token of each sequence only.
    return tokens * LAYERS * (4 * DIM * DIM + 2 * DIM * FFN) + BATCH * DIM * DIM


ATTENTION_MACS = LAYERS * BATCH * HEADS * SEQ * SEQ * 2 * (DIM // HEADS)  # q@k^T and p@v per layer


@pytest.mark.parametrize("build", [gpt2, bert], ids=["gpt2", "bert"])
def test_eager_matmuls_agree_with_flop_counter_mode(build):
    model, inputs = build("eager"), batch()
    expected = reference_flops(lambda: model(**inputs))
    prof = profiled(model, lambda: model(**inputs))
    assert expected > 0
    assert 2 * prof.get_total_macs() == expected
    assert prof.get_total_flops() > expected  # plus layer norm, softmax, gelu, residual adds
    ops = prof.get_op_breakdown()
    assert ops["aten.bmm"]["macs"] == ATTENTION_MACS
    prof.end_profile()


@pytest.mark.parametrize("build", [gpt2, bert], ids=["gpt2", "bert"])
def test_sdpa_path_matches_analytic_count_and_eager(build):
    eager, sdpa, inputs = build("eager"), build("sdpa"), batch()
    assert sdpa.config._attn_implementation == "sdpa"
    prof = profiled(sdpa, lambda: sdpa(**inputs))
    ops = prof.get_op_breakdown()
    fused = ops["aten._scaled_dot_product_flash_attention_for_cpu"]
    assert fused["calls"] == LAYERS and fused["macs"] == ATTENTION_MACS
    assert prof.get_total_macs() == linear_macs(sdpa) + ATTENTION_MACS
    eager_prof = profiled(eager, lambda: eager(**inputs))
    assert prof.get_total_macs() == eager_prof.get_total_macs()
    # FlopCounterMode prices the linears but has no formula for the CPU fused kernel (see module docstring).
    assert reference_flops(lambda: sdpa(**inputs)) == 2 * (prof.get_total_macs() - ATTENTION_MACS)
    prof.end_profile()
    eager_prof.end_profile()


@pytest.mark.parametrize("build", [gpt2, bert], ids=["gpt2", "bert"])
def test_eager_linears_match_analytic_count(build):
    model, inputs = build("eager"), batch()
    prof = profiled(model, lambda: model(**inputs))
    assert prof.get_total_macs() == linear_macs(model) + ATTENTION_MACS
    prof.end_profile()


def test_generate_mode_agrees_with_flop_counter_mode_and_analytic_count():
    model, inputs = gpt2("eager"), batch()
    inputs["attention_mask"] = inputs["attention_mask"].flip(1)  # left padding, as for decoder-only generation
    kwargs = {**inputs, "max_new_tokens": 2, "do_sample": False}
    expected = reference_flops(lambda: model.generate(**kwargs))
    flops, macs, params = get_model_profile(model, kwargs=kwargs, mode="generate", print_profile=False,
                                            as_string=False, warm_up=0)
    assert 2 * macs == expected
    # Two forwards: the prompt (SEQ tokens), then one cached step (1 token attending to SEQ + 1 keys); HF
    # computes logits for the last position only in both.
    head_dim, block = DIM // HEADS, 12 * DIM * DIM
    prompt = BATCH * SEQ * LAYERS * block + ATTENTION_MACS + BATCH * DIM * VOCAB
    step = BATCH * LAYERS * block + LAYERS * BATCH * HEADS * (SEQ + 1) * 2 * head_dim + BATCH * DIM * VOCAB
    assert macs == prompt + step
    assert flops > 2 * macs
    assert params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("build", [gpt2, bert], ids=["gpt2", "bert"])
def test_training_step_agrees_with_flop_counter_mode(build):
    model, inputs = build("eager"), batch()
    model.train()

    def step():
        out = model(**inputs)
        first = out.logits if hasattr(out, "logits") else out.last_hidden_state
        first.float().pow(2).mean().backward()

    with FlopCounterMode(display=False) as counter:
        step()
    expected = counter.get_total_flops()
    model.zero_grad(set_to_none=True)
    prof = FlopsProfiler(model)
    prof.start_profile()
    try:
        step()
        total_macs = prof.get_total_macs() + prof.get_total_backward_macs()
        assert prof.backward_observed()
    finally:
        prof.end_profile()
    assert 2 * total_macs == expected

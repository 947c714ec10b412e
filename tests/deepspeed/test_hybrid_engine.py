"""``hybrid_engine.enabled``: DeepSpeed-Chat's actor engine trains and generates with the same weights; under
ZeRO-3 the weights are gathered once per ``generate`` and held for all of its decoding steps."""

from __future__ import annotations

import torch
from _harness import run_distributed

PROMPT = [[5, 9, 2, 7], [1, 3, 3, 8]]


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config).eval()


def _reference_tokens() -> list:
    model = _model()
    with torch.no_grad():
        return model.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()


def _body(stage: int) -> dict:
    import deepspeed
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage,
                                                                  "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "hybrid_engine": {"enabled": True},
        "steps_per_print": 1000})
    partitioned = [p for p in engine.module.parameters() if hasattr(p, "ds_status")]
    whole_at_each_forward: list[bool] = []
    engine.module.register_forward_pre_hook(lambda m, a: whole_at_each_forward.append(
        all(p.ds_status.name == "AVAILABLE" for p in partitioned)))
    engine.eval()
    tokens = engine.module.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, pad_token_id=0)
    released = [p.ds_status.name for p in partitioned]
    during = list(whole_at_each_forward)
    engine.train()
    ids = torch.tensor(PROMPT)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return {"hybrid": isinstance(engine, DeepSpeedHybridEngine), "tokens": tokens.tolist(),
            "same_call": engine.module.generate == engine.generate, "forwards": during,
            "released": sorted(set(released)), "loss": float(loss), "latency": engine._generate_latency > 0}


def test_zero3_generates_the_reference_tokens_with_weights_gathered_once():
    want = _reference_tokens()
    for out in run_distributed(_body, world_size=2, args=(3,), timeout=120):
        assert out["hybrid"] and out["same_call"] and out["latency"]
        assert out["tokens"] == want
        assert len(out["forwards"]) == 6 and all(out["forwards"])  # every decoding step saw whole weights
        assert out["released"] == ["NOT_AVAILABLE"]  # and they are partitions again afterwards
        assert out["loss"] > 0


def test_without_zero3_it_is_the_module_generate():
    out = run_distributed(_body, world_size=1, args=(0,), timeout=120)[0]
    assert out["hybrid"] and out["tokens"] == _reference_tokens() and out["released"] == []


def _client_hooks_body() -> dict:
    """What TRL does around generation under ZeRO-3, through DeepSpeed's parameter_offload API."""
    import deepspeed

    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 1000})
    offload = engine.optimizer.parameter_offload
    hooks_before = len(offload.forward_hooks)
    with deepspeed.zero.GatheredParameters(engine.module.parameters()):
        externals = list(offload.module.ds_external_parameters())
        for p in list(offload.module.parameters()) + [p for _, p in externals]:
            p.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        tokens = engine.module.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, pad_token_id=0)
        if not offload.param_coordinator.is_invalid_trace():
            offload.param_coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
    ids = torch.tensor(PROMPT)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    try:
        offload._register_deepspeed_module(torch.nn.Linear(1, 1))
    except ValueError as exc:
        wrong = str(exc)
    return {"hooks": (hooks_before, len(offload.forward_hooks)), "tokens": tokens.tolist(), "loss": float(loss),
            "externals": externals, "wrong": wrong,
            "released": sorted({p.ds_status.name for p in engine.module.parameters() if not p.ds_persist})}


def test_client_removes_and_restores_zero3_hooks_around_generation():
    want = _reference_tokens()
    for out in run_distributed(_client_hooks_body, world_size=2, timeout=120):
        assert out["hooks"][0] > 0 and out["hooks"][1] == out["hooks"][0]
        assert out["tokens"] == want and out["loss"] > 0 and out["externals"] == []
        assert out["released"] == ["NOT_AVAILABLE"]
        assert "pass parameter_offload.module" in out["wrong"]


def _freeze_after_init_body(quantize_frozen: bool) -> dict:
    """DeepSpeed-Chat freezes weights after the engine is built, then asks ZeRO++ to store them int8."""
    import deepspeed
    from ds_zero.zeropp.frozen import is_stored_quantized

    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "zero_quantized_nontrainable_weights": quantize_frozen},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    frozen = engine.module.transformer.wte.weight
    frozen.requires_grad_(False)
    converted = engine.optimizer.quantize_nontrainable_params()
    ids = torch.tensor(PROMPT)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return {"converted": converted, "stored_int8": is_stored_quantized(frozen), "loss": float(loss)}


def test_quantize_nontrainable_params_after_freezing():
    on = run_distributed(_freeze_after_init_body, world_size=2, args=(True,), timeout=120)[0]
    assert on["converted"] == 1 and on["stored_int8"] and on["loss"] > 0
    off = run_distributed(_freeze_after_init_body, world_size=2, args=(False,), timeout=120)[0]
    assert off["converted"] == 0 and not off["stored_int8"]

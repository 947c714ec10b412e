"""init_inference / InferenceEngine on one process: outputs equal the plain model, dtypes, int8, config handling."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from _inference_models import BUILDERS, GENERATIVE, tiny_gpt2, tiny_llama, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import ds_inference
from ds_config import ConfigError
from ds_inference import InferenceEngine, TokenLimitError, default_inference_config, init_inference
from ds_inference._config import build_config
from ds_inference.quantization import is_quantized, model_bytes

FP32 = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def pair(request):
    """(name, plain model, engine over an identical copy in fp32)."""
    model = BUILDERS[request.param]()
    return request.param, model, init_inference(copy.deepcopy(model), dtype=torch.float)


@torch.no_grad()
def test_logits_and_greedy_tokens_equal_the_plain_model(pair):
    name, model, engine = pair
    ids = token_ids()
    assert isinstance(engine, InferenceEngine) and isinstance(engine.module, type(model))
    torch.testing.assert_close(engine(input_ids=ids).logits, model(input_ids=ids).logits, **FP32)
    torch.testing.assert_close(engine(ids).logits, model(ids).logits, **FP32)  # positional inputs too
    if name in GENERATIVE:
        mask = torch.ones_like(ids)
        ours = engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert ours.shape == (2, 14) and torch.equal(ours, ref)
    else:
        assert hasattr(engine, "generate") == hasattr(model, "generate")  # only a model with generate gets one


@pytest.mark.parametrize("dtype,tol", [(torch.half, 5e-3), ("bf16", 3e-2), (torch.float, 1e-6)])
@torch.no_grad()
def test_dtype_conversion(dtype, tol):
    model = tiny_llama()
    engine = init_inference(copy.deepcopy(model), dtype=dtype)
    want = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    assert {p.dtype for p in engine.module.parameters()} == {want}
    ids = token_ids()
    got = engine(input_ids=ids).logits.float()
    ref = model(input_ids=ids).logits
    assert (got - ref).abs().max().item() <= tol * ref.abs().max().item()  # measured 0.09% fp16, 0.6% bf16


@torch.no_grad()
def test_int8_weights_are_quantized_in_groups_with_bounded_logit_error():
    model = tiny_gpt2()
    engine = init_inference(copy.deepcopy(model), dtype=torch.int8, quant={"weight": {"q_groups": 4}})
    # c_attn, c_proj, c_fc, mlp.c_proj x 2 layers, the position embedding, and the token embedding tied to lm_head
    assert len(engine.quantized_modules) == 11
    assert all(is_quantized(engine.module.get_submodule(n)) for n in engine.quantized_modules)
    module = engine.module
    assert module.transformer.h[0].attn.c_attn.weight_q.dtype == torch.int8
    assert module.lm_head.weight_q is module.transformer.wte.weight_q and module.transformer.wte.weight is None
    assert module.transformer.wte.weight_scale.shape == (4, 1)  # q_groups scales per weight
    ratio = model_bytes(engine.module) / model_bytes(model)
    assert ratio <= 0.3, ratio  # measured 0.263: 1 byte per weight, fp32 biases, norms and scales
    ids = token_ids()
    ref = model(input_ids=ids).logits
    got = engine(input_ids=ids).logits
    # stated tolerance: 2% of the largest |logit| (measured ~1%); the quantized model is not the float one
    err = (got - ref).abs().max().item()
    assert 0 < err <= 0.02 * ref.abs().max().item()
    out = engine.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 11)


def test_max_tokens_is_enforced_with_a_clear_error():
    engine = init_inference(tiny_gpt2(), dtype=torch.float, max_tokens=12)
    ids = token_ids(length=8)
    mask = torch.ones_like(ids)
    assert engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False).shape[1] == 12
    with pytest.raises(TokenLimitError, match=r"8 input \+ 5 new tokens = 13.*max_tokens \(max_out_tokens\) = 12"):
        engine.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5)
    with pytest.raises(RuntimeError, match="max_tokens"):  # DeepSpeed raises a RuntimeError here
        engine.generate(ids, attention_mask=mask, max_length=20)
    with pytest.raises(TokenLimitError, match="8 input"):  # the prompt given as HF's ``inputs=`` keyword
        engine.generate(inputs=ids, attention_mask=mask, max_new_tokens=5)
    # min_tokens: the room the caller needs after the prompt, checked before generating
    strict = init_inference(tiny_gpt2(), dtype=torch.float, max_tokens=12, min_tokens=5)
    with pytest.raises(TokenLimitError, match="8 input \\+ 5 new tokens = 13"):
        strict.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1)


def test_config_dict_json_and_kwargs(tmp_path):
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "tensor_parallel": {"tp_size": 1}, "max_tokens": 64}))
    engine = init_inference(tiny_gpt2(), config=str(path), replace_method="auto")
    assert engine._config.max_out_tokens == 64 and next(engine.module.parameters()).dtype == torch.float32
    assert engine.config is engine.module.config  # DeepSpeed's engine.config is the model's config
    # the same value twice (in two spellings of the dtype) is fine; different values name the key
    init_inference(tiny_gpt2(), config={"dtype": "fp32"}, dtype=torch.float)
    with pytest.raises(ConfigError, match="conflicting argument 'max_tokens'.*64.*32"):
        init_inference(tiny_gpt2(), config=str(path), max_tokens=32)
    with pytest.raises(ConfigError, match="dtype"):
        init_inference(tiny_gpt2(), config={"dtype": "fp16"}, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="max_tokenz"):
        init_inference(tiny_gpt2(), max_tokenz=3)
    with pytest.raises(TypeError, match="config"):
        init_inference(tiny_gpt2(), config=3)


@settings(max_examples=40, deadline=None)
@given(in_config=st.integers(1, 4096), in_kwargs=st.integers(1, 4096),
       config_key=st.sampled_from(["max_tokens", "max_out_tokens"]),
       kwargs_key=st.sampled_from(["max_tokens", "max_out_tokens"]))
def test_config_and_kwargs_merge_unless_they_disagree(in_config, in_kwargs, config_key, kwargs_key):
    """Also across the two spellings of one key (its name and its alias)."""
    if in_config == in_kwargs:
        merged = build_config({config_key: in_config, "tm": False}, **{kwargs_key: in_kwargs})
        assert merged.max_out_tokens == in_config and merged.triangular_masking is False
    else:
        with pytest.raises(ConfigError, match=f"conflicting argument '{config_key}' in 'config': {in_config} and "
                                              f"(kwargs|'{kwargs_key}' in kwargs): {in_kwargs}") as info:
            build_config({config_key: in_config}, **{kwargs_key: in_kwargs})
        assert info.value.paths == [kwargs_key]


def test_default_inference_config_and_default_dtype():
    defaults = default_inference_config()
    assert defaults["max_out_tokens"] == 1024 and defaults["tensor_parallel"]["tp_size"] == 1
    assert defaults["dtype"] is torch.float16  # DeepSpeed documents the field as torch.dtype = torch.float16
    engine = init_inference(tiny_llama())  # documented default dtype: torch.float16
    assert next(engine.module.parameters()).dtype == torch.float16


def test_cpu_only_options_warn_once_and_run_the_plain_path():
    ds_inference.engine._WARNED.clear()
    model = tiny_gpt2()
    ids = token_ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = init_inference(copy.deepcopy(model), dtype=torch.float, kernel_inject=True, use_triton=True,
                                enable_cuda_graph=not torch.cuda.is_available())
        init_inference(copy.deepcopy(model), dtype=torch.float, kernel_inject=True)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert sum("kernel_inject" in m for m in messages) == 1  # once per process
    assert any("triton" in m for m in messages)
    if not torch.cuda.is_available():
        assert any("enable_cuda_graph" in m for m in messages)
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, model(input_ids=ids).logits, **FP32)


def test_bad_arguments():
    assert not hasattr(init_inference(torch.nn.Linear(2, 2), dtype=torch.float), "generate")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        init_inference("not a model")
    with pytest.raises(ValueError, match="exclude each other"):
        init_inference(tiny_gpt2(), kernel_inject=True, injection_policy={torch.nn.Linear: ("c_proj",)})
    with pytest.raises(ValueError, match=r"dtype=int8 .* quant.weight.enabled = False; set it to True"):
        init_inference(tiny_gpt2(), dtype=torch.int8, quant={"weight": {"enabled": False}})
    with pytest.raises(ValueError, match="q_groups=7"):
        init_inference(tiny_gpt2(), dtype=torch.int8, quant={"weight": {"q_groups": 7}})
    with pytest.raises(RuntimeError, match="tp_size=2 needs torch.distributed"):
        init_inference(tiny_gpt2(), tensor_parallel={"tp_size": 2})


def test_served_by_deepspeed():
    import deepspeed
    import deepspeed.inference.config as config_module
    import deepspeed.inference.engine as engine_module

    assert deepspeed.init_inference is init_inference
    assert deepspeed.InferenceEngine is InferenceEngine is engine_module.InferenceEngine
    assert deepspeed.default_inference_config is default_inference_config
    assert config_module.DeepSpeedInferenceConfig is deepspeed.DeepSpeedInferenceConfig
    with pytest.raises(ModuleNotFoundError, match="inference"):
        import deepspeed.inference.v2  # noqa: F401 - FastGen stays unbuilt


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_graph_replay_equals_eager():
    model = tiny_gpt2().cuda()
    engine = init_inference(copy.deepcopy(model), dtype=torch.float, enable_cuda_graph=True)
    assert engine._graph is not None
    for seed in (1, 2):  # the second call replays the graph captured by the first, on new inputs
        ids = token_ids(seed=seed).cuda()
        torch.testing.assert_close(engine(input_ids=ids, use_cache=False).logits.clone(),
                                   model(input_ids=ids, use_cache=False).logits, **FP32)
    assert len(engine._graph.graphs) == 1

"""Drop-in details of the inference engine: ``_config.dtype`` is a torch.dtype, beam search is refused as in
DeepSpeed, and checkpoint tensors the model does not have are reported."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _inference_models import tiny_gpt2, tiny_llama, token_ids

from ds_config.inference import DeepSpeedInferenceConfig
from ds_inference import InferenceEngine, init_inference
from ds_inference.engine import BeamSearchError


@pytest.mark.parametrize("given,want", [(None, torch.float16), ("bf16", torch.bfloat16), (torch.float, torch.float32),
                                        ("half", torch.float16), ("int8", torch.int8)])
def test_engine_config_dtype_is_a_torch_dtype(given, want):
    kwargs = {} if given is None else {"dtype": given}
    engine = init_inference(tiny_gpt2(), **kwargs)
    assert engine._config.dtype is want and isinstance(engine._config, DeepSpeedInferenceConfig)
    assert (engine._config.dtype == torch.half) is (want is torch.float16)  # what DeepSpeed scripts test
    # an already typed ds_config object gets the same engine view, without losing what was set
    typed = DeepSpeedInferenceConfig(**kwargs, max_tokens=64)
    engine = InferenceEngine(tiny_gpt2(), typed)
    assert engine._config.dtype is want and engine._config.max_out_tokens == 64
    assert "max_out_tokens" in engine._config.model_fields_set
    # ds_config's own (torch-free) enum still compares equal to the torch.dtype, both ways round
    assert typed.dtype == want and want == typed.dtype and typed.dtype != torch.float64


def test_beam_search_is_refused_as_in_deepspeed():
    model = tiny_llama()
    engine = init_inference(copy.deepcopy(model), dtype=torch.float)
    ids = token_ids()
    with pytest.raises(NotImplementedError, match=r"generate: num_beams=3 asks for beam search.*accepted: num_beams=1"):
        engine.generate(input_ids=ids, max_new_tokens=2, num_beams=3)
    config = copy.deepcopy(model.generation_config)
    config.num_beams = 2
    with pytest.raises(BeamSearchError, match=r"generation_config.num_beams=2"):
        engine.generate(input_ids=ids, max_new_tokens=2, generation_config=config)
    with pytest.raises(ValueError, match="num_beams=4"):  # the argument wins over the generation config
        engine.generate(input_ids=ids, max_new_tokens=2, generation_config=config, num_beams=4)
    out = engine.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, num_beams=1,
                          do_sample=False)
    assert out.shape == (2, 10)


def test_checkpoint_keys_the_model_lacks_are_reported(tmp_path):
    model = tiny_gpt2()
    state = dict(model.state_dict())
    state.update({f"extra.block{i}.weight": torch.zeros(2) for i in range(7)})
    path = tmp_path / "model.pt"
    torch.save(state, path)
    with pytest.warns(UserWarning, match=r"7 tensor\(s\) the model does not have were ignored \(unexpected keys: "
                                         r"'extra.block0.weight', .* and 2 more") as record:
        engine = init_inference(tiny_gpt2(seed=3), checkpoint=str(path), dtype=torch.float)
    assert "extra.block6.weight" not in str(record[0].message)  # a few of them, not all
    torch.testing.assert_close(engine.module.lm_head.weight, model.lm_head.weight)  # the rest was loaded
    torch.save(model.state_dict(), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact checkpoint loads without a word
        init_inference(tiny_gpt2(seed=3), checkpoint=str(path), dtype=torch.float)

"""``deepspeed.module_inject`` serves AutoTP (``ds_inference.autotp``) under DeepSpeed's names;
``replace_transformer_layer`` asked for kernel injection warns and shards with AutoTP; AutoEP's layer stays."""

from __future__ import annotations

import pytest
import torch
from _autotp_models import ids, output, tiny
from _harness import run_distributed


def test_names_and_paths():
    import deepspeed
    import deepspeed.module_inject as module_inject
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    from ds_inference import autotp
    from ds_moe.autoep import AutoEPMoELayer as ours

    assert (LinearLayer, LinearAllreduce) == (autotp.LinearLayer, autotp.LinearAllreduce)
    assert module_inject.replace_transformer_layer is autotp.replace_transformer_layer
    assert deepspeed.set_autotp_mode is module_inject.set_autotp_mode is autotp.set_autotp_mode
    assert AutoEPMoELayer is ours
    with pytest.raises(AttributeError, match="kernel injection"):
        module_inject.HFBertLayerPolicy  # noqa: B018
    with pytest.raises(ImportError, match="kernel injection"):
        import deepspeed.module_inject.containers  # noqa: F401


def _module_inject_path() -> tuple:
    import warnings

    from deepspeed.module_inject import AutoTP, LinearAllreduce, replace_transformer_layer

    ref, model, tokens = tiny("gpt2"), tiny("gpt2"), ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replace_transformer_layer(None, model, None, {"replace_with_kernel_inject": True,
                                                       "tensor_parallel": {"tp_size": 2}}, None)
    torch.testing.assert_close(output(model, tokens), output(ref, tokens), rtol=0, atol=1e-5)
    parsed = AutoTP.tp_parser(tiny("bert"))
    return ([str(w.message) for w in caught if "kernel" in str(w.message)],
            isinstance(model.transformer.h[0].attn.c_proj, LinearAllreduce),
            [(cls.__name__, rows) for cls, rows in parsed])


def test_module_inject_replace_transformer_layer_takes_the_autotp_path():
    messages, row_parallel, parsed = run_distributed(_module_inject_path, world_size=2, timeout=120)[0]
    assert messages and "not available" in messages[0]
    assert row_parallel
    assert parsed == [("BertLayer", ("attention.output.dense", "output.dense"))]

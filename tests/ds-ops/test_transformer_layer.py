"""``deepspeed.ops.transformer``: the torch transformer kernel layer against Hugging Face's ``BertLayer`` (Post-LN)
and a hand-written Pre-LN reference on the same weights, outputs and gradients; the memory options keep fewer
activation bytes for backward (counted with ``saved_tensors_hooks``) while giving the same results."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer

from ds_ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

BATCH, SEQ, HIDDEN, HEADS, INTER = 2, 6, 32, 4, 64


def _config(**overrides) -> DeepSpeedTransformerConfig:
    options = dict(batch_size=BATCH, hidden_size=HIDDEN, intermediate_size=INTER, heads=HEADS,
                   attn_dropout_ratio=0.0, hidden_dropout_ratio=0.0, num_hidden_layers=2, initializer_range=0.02,
                   pre_layer_norm=False)
    options.update(overrides)
    return DeepSpeedTransformerConfig(**options)


def _bert_layer(dtype=torch.float32) -> BertLayer:
    config = BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=INTER,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    layer = BertLayer(config).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)  # away from the identity init, so every weight matters
    return layer


def _bert_weights(ref: BertLayer) -> tuple[list, list]:
    attn = ref.attention
    modules = [attn.self.query, attn.self.key, attn.self.value, attn.output.dense, attn.output.LayerNorm,
               ref.intermediate.dense, ref.output.dense, ref.output.LayerNorm]
    return [m.weight for m in modules], [m.bias for m in modules]


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=dtype)
    mask = torch.zeros(BATCH, 1, 1, SEQ, dtype=dtype)
    mask[1, ..., 4:] = -10000.0  # Hugging Face's extended mask: the second sequence has 2 padding tokens
    return x, mask


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def test_post_ln_equals_hf_bert_layer_outputs_and_gradients():
    ref = _bert_layer()
    weights, biases = _bert_weights(ref)
    layer = DeepSpeedTransformerLayer(_config(), weights, biases)
    x, mask = _inputs()
    x_ref, x_ds = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = _first(ref(x_ref, attention_mask=mask))
    out = layer(x_ds, mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

    upstream = torch.randn_like(out)
    expected.backward(upstream)
    out.backward(upstream)
    torch.testing.assert_close(x_ds.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    ref_w, ref_b = _bert_weights(ref)
    torch.testing.assert_close(layer.attn_qkvw.grad, torch.cat([w.grad for w in ref_w[:3]]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.attn_qkvb.grad, torch.cat([b.grad for b in ref_b[:3]]), rtol=1e-4, atol=1e-5)
    names = ("attn_o", "attn_n", "inter_", "output_", "norm_")
    for prefix, w, b in zip(names, ref_w[3:], ref_b[3:], strict=True):
        torch.testing.assert_close(getattr(layer, f"{prefix}w").grad, w.grad, rtol=1e-4, atol=1e-5, msg=prefix)
        torch.testing.assert_close(getattr(layer, f"{prefix}b").grad, b.grad, rtol=1e-4, atol=1e-5, msg=prefix)


def _pre_ln_reference(layer: DeepSpeedTransformerLayer, x, mask):
    """Pre-LN BERT layer written with plain torch ops from the layer's parameters."""
    heads, eps = HEADS, layer.config.layer_norm_eps

    def split(t):
        return t.view(BATCH, SEQ, heads, -1).transpose(1, 2)

    normed = F.layer_norm(x, (HIDDEN,), layer.attn_nw, layer.attn_nb, eps)
    q, k, v = (split(t) for t in (normed @ layer.attn_qkvw.t() + layer.attn_qkvb).chunk(3, dim=-1))
    probs = torch.softmax(q @ k.transpose(-1, -2) / (HIDDEN // heads) ** 0.5 + mask, dim=-1)
    context = (probs @ v).transpose(1, 2).reshape(BATCH, SEQ, HIDDEN)
    attended = x + context @ layer.attn_ow.t() + layer.attn_ob
    normed = F.layer_norm(attended, (HIDDEN,), layer.norm_w, layer.norm_b, eps)
    hidden = F.gelu(normed @ layer.inter_w.t() + layer.inter_b)
    return attended + hidden @ layer.output_w.t() + layer.output_b


def test_pre_ln_equals_hand_reference_outputs_and_gradients():
    torch.manual_seed(0)
    layer = DeepSpeedTransformerLayer(_config(pre_layer_norm=True, initializer_range=0.3))
    with torch.no_grad():  # non-trivial LayerNorm affine parameters and biases
        for name in ("attn_nw", "attn_nb", "norm_w", "norm_b", "attn_qkvb", "inter_b"):
            getattr(layer, name).add_(torch.randn_like(getattr(layer, name)) * 0.2)
    x, mask = _inputs()
    x_ref, x_ds = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = _pre_ln_reference(layer, x_ref, mask)
    ref_grads = torch.autograd.grad(expected.square().sum(), [x_ref, *layer.parameters()])
    out = layer(x_ds, mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [x_ds, *layer.parameters()])
    for (name, _), mine, ref in zip([("input", None), *layer.named_parameters()], grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4, msg=name)


def _saved_activation_bytes(layer, x, mask):
    """Output, gradients and the bytes autograd keeps for backward beyond the parameters, the input and the output
    (which are alive anyway); storages counted once."""
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, mask)
    alive = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    alive |= {x.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()}
    activation = sum(n for ptr, n in saved.items() if ptr not in alive)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    return out, grads, activation


@pytest.mark.parametrize("pre_layer_norm", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("option", ["gelu_checkpoint", "attn_dropout_checkpoint", "normalize_invertible"])
def test_memory_options_save_activations_with_equal_results(option, pre_layer_norm):
    dtype = torch.float64
    item = torch.finfo(dtype).bits // 8
    x, mask = _inputs(dtype)
    x = x.requires_grad_()
    results = {}
    for enabled in (False, True):
        torch.manual_seed(0)  # same weights, and (seed=-1) the same dropout masks from torch's generator
        layer = DeepSpeedTransformerLayer(_config(attn_dropout_ratio=0.2, hidden_dropout_ratio=0.1,
                                                  pre_layer_norm=pre_layer_norm, initializer_range=0.3,
                                                  **{option: enabled})).to(dtype)
        results[enabled] = _saved_activation_bytes(layer, x, mask)
    (out0, grads0, bytes0), (out1, grads1, bytes1) = results[False], results[True]
    torch.testing.assert_close(out1, out0, rtol=1e-10, atol=1e-10)
    for mine, ref in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-8, atol=1e-10)
    expected_saving = {  # what each option stops keeping
        "gelu_checkpoint": BATCH * SEQ * INTER * item,  # the GeLU output
        "attn_dropout_checkpoint": BATCH * HEADS * SEQ * SEQ * item,  # the dropped-out attention probabilities
        # the LayerNorm inputs: Post-LN both norms' (the second's output is the layer output), Pre-LN the second's
        "normalize_invertible": (1 if pre_layer_norm else 2) * BATCH * SEQ * HIDDEN * item,
    }[option]
    assert bytes0 - bytes1 >= expected_saving, (option, bytes0, bytes1)


def test_dropout_is_seeded_per_layer_and_off_in_eval():
    layer = DeepSpeedTransformerLayer(_config(attn_dropout_ratio=0.3, hidden_dropout_ratio=0.3, seed=7))
    x, mask = _inputs()
    torch.manual_seed(0)
    first = layer(x, mask)
    torch.manual_seed(0)  # the layer's own generator (seed >= 0) is not torch's global one: it advances
    assert not torch.allclose(layer(x, mask), first)
    twin = DeepSpeedTransformerLayer(_config(attn_dropout_ratio=0.3, hidden_dropout_ratio=0.3, seed=7))
    twin.load_state_dict(layer.state_dict())
    twin.layer_id = layer.layer_id  # same seed and layer index: the same masks
    torch.testing.assert_close(twin(x, mask), first)
    layer.eval()
    with torch.no_grad():
        torch.testing.assert_close(layer(x, mask), twin.eval()(x, mask))
        assert not torch.allclose(layer(x, mask), first)


def test_stochastic_mode_uses_fused_dropout_and_trains():
    layer = DeepSpeedTransformerLayer(_config(attn_dropout_ratio=0.5, stochastic_mode=True))
    x, mask = _inputs()
    out = layer(x, mask)
    with torch.no_grad():
        assert not torch.allclose(out, layer.eval()(x, mask))
    out.sum().backward()
    assert torch.isfinite(layer.attn_qkvw.grad).all() and layer.attn_qkvw.grad.abs().sum() > 0


def test_config_options_return_tuple_training_grads_and_boolean_mask():
    layer = DeepSpeedTransformerLayer(_config(return_tuple=True, training=False))
    assert not layer.training
    x, mask = _inputs()
    out = layer(x, mask)
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(layer(x, mask[..., :] > -1)[0], out[0])  # boolean mask: True = attend
    grads: list = []
    layer.train()
    layer(x, mask)[0].sum().backward()
    layer(x, mask, grads=grads)[0].sum().backward()
    labels = {label for _, label in grads}
    assert {"Q_W", "K_W", "V_W", "O_W", "norm_B"} <= labels and len(grads) == 16
    assert layer.config.layer_id == layer.layer_id


def test_init_ranges_and_intermediate_default():
    torch.manual_seed(0)
    config = _config(hidden_size=256, intermediate_size=-1, heads=8, num_hidden_layers=8, initializer_range=0.05)
    layer = DeepSpeedTransformerLayer(config)
    assert layer.inter_w.shape == (1024, 256) and layer.output_w.shape == (256, 1024)
    assert abs(layer.attn_qkvw.std().item() - 0.05) < 0.005
    assert abs(layer.output_w.std().item() - 0.05 / 4) < 0.002  # adjust_init_range: std / sqrt(2 * 8)
    assert torch.equal(layer.norm_w, torch.ones(256)) and torch.equal(layer.attn_qkvb, torch.zeros(768))
    flat = DeepSpeedTransformerLayer(_config(adjust_init_range=False, initializer_range=0.05, hidden_size=256,
                                             heads=8, intermediate_size=1024))
    assert abs(flat.output_w.std().item() - 0.05) < 0.005


def test_fp16_option_builds_half_weights():
    layer = DeepSpeedTransformerLayer(_config(fp16=True, training=False))
    assert layer.attn_qkvw.dtype == torch.float16
    x, mask = _inputs()
    out = layer(x.half(), mask.half())
    reference = DeepSpeedTransformerLayer(_config(training=False))
    reference.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    torch.testing.assert_close(out.float(), reference(x, mask), rtol=2e-2, atol=2e-2)


def test_config_from_dict_and_json_file(tmp_path):
    config = _config(pre_layer_norm=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()), encoding="utf-16")  # DeepSpeed's encoding
    loaded = DeepSpeedTransformerConfig.from_json_file(path)
    assert loaded.to_dict() == config.to_dict()
    path.write_text(json.dumps({"hidden_size": 16, "heads": 2}), encoding="utf-8")
    assert DeepSpeedTransformerConfig.from_json_file(path).hidden_size == 16
    with pytest.raises(ValueError, match="hiden_size"):
        DeepSpeedTransformerConfig.from_dict({"hiden_size": 16})


@pytest.mark.parametrize("overrides, match", [
    (dict(heads=5), "divisible by heads"),
    (dict(hidden_size=-1), "hidden_size must be a positive int"),
    (dict(attn_dropout_ratio=-1), "attn_dropout_ratio must be in"),
    (dict(hidden_dropout_ratio=1.0), "hidden_dropout_ratio must be in"),
    (dict(initializer_range=-1), "initializer_range must be positive"),
    (dict(num_hidden_layers=-1), "num_hidden_layers must be a positive int"),
])
def test_bad_options_are_clear_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        DeepSpeedTransformerLayer(_config(**overrides))


def test_unsupported_forward_arguments_are_clear_errors():
    layer = DeepSpeedTransformerLayer(_config())
    x, mask = _inputs()
    with pytest.raises(ValueError, match="encoder_hidden_states is not supported"):
        layer(x, mask, encoder_hidden_states=x)
    with pytest.raises(ValueError, match="output_attentions"):
        layer(x, mask, output_attentions=True)
    with pytest.raises(ValueError, match=r"hidden_states must be \[batch, seq, 32\]"):
        layer(x[..., :16], mask)
    with pytest.raises(TypeError, match="DeepSpeedTransformerConfig"):
        DeepSpeedTransformerLayer({"hidden_size": 32})

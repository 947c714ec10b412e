"""deepspeed.ops.sparse_attention: DeepSpeed's block layouts, and torch sparse attention equal to masked dense.

Expected layouts below are DeepSpeed's (derived from its ``sparsity_config.py`` rules for these configs; the
installed reference DeepSpeed 0.19.8 no longer ships sparse_attention, so they could not be recorded by running it).
Random blocks (BigBird, Variable) are checked against ``random.sample`` replayed after the same ``random.seed``,
which is how DeepSpeed draws them.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
import torch.nn.functional as F

from ds_ops.sparse_attention import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseAttentionUtils,
    SparseSelfAttention,
    SparsityConfig,
    VariableSparsityConfig,
)


def _rows(*rows: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in row] for row in rows], dtype=torch.int64)


LAYOUTS = {
    "fixed": (lambda: FixedSparsityConfig(2), 128, [_rows(*["11110001"] * 4, *["00011111"] * 4)] * 2),
    "fixed_unidirectional_short_last_window": (
        lambda: FixedSparsityConfig(1, attention="unidirectional"), 160,
        [_rows("1000000000", "1100000000", "1110000000", "1111000000", "0001100000", "0001110000", "0001111000",
               "0001111100", "0001000110", "0001000111")]),
    "fixed_horizontal_two_global_patterns": (
        lambda: FixedSparsityConfig(2, different_layout_per_head=True, num_different_global_patterns=2,
                                    horizontal_global_attention=True), 96,
        [_rows("111101", "111101", "111101", "111111", "000111", "111111"),
         _rows("111101", "111101", "111111", "111101", "001011", "111111")]),
    "fixed_two_global_blocks": (
        lambda: FixedSparsityConfig(1, num_local_blocks=4, num_global_blocks=2), 160,
        [_rows(*["1111001111"] * 4, *["0011111111"] * 4, *["0011001111"] * 2)]),
    "variable_windows": (
        lambda: VariableSparsityConfig(1, local_window_blocks=[2, 3], global_block_indices=[0]), 128,
        [_rows("11000000", "11000000", *["10111000"] * 3, *["10000111"] * 3)]),
    "variable_global_range_unidirectional": (
        lambda: VariableSparsityConfig(1, local_window_blocks=[3], global_block_indices=[1],
                                       global_block_end_indices=[3], attention="unidirectional"), 128,
        [_rows("10000000", "11100000", "11100000", "01110000", "01111000", "01111100", "01100010", "01100011")]),
    "bslongformer": (
        lambda: BSLongformerSparsityConfig(1, num_sliding_window_blocks=3, global_block_indices=[0, 5]), 128,
        [_rows("11111111", "11100100", "11110100", "10111100", "10011100", "11111111", "10000111", "10000111")]),
    "local_unidirectional": (
        lambda: LocalSlidingWindowSparsityConfig(1, num_sliding_window_blocks=3), 96,
        [_rows("100000", "110000", "011000", "001100", "000110", "000011")]),
    "local_bidirectional": (
        lambda: LocalSlidingWindowSparsityConfig(1, num_sliding_window_blocks=5, attention="bidirectional"), 96,
        [_rows("111000", "111100", "111110", "011111", "001111", "000111")]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layouts_match_deepspeed(name):
    make, seq_len, expected = LAYOUTS[name]
    layout = make().make_layout(seq_len)
    assert layout.dtype == torch.int64
    assert torch.equal(layout, torch.stack(expected)), f"{name}:\n{layout}"


def test_dense_layout_and_shapes():
    layout = DenseSparsityConfig(num_heads=3, block=8).make_layout(40)
    assert layout.shape == (3, 5, 5) and bool((layout == 1).all())
    with pytest.raises(ValueError, match="dividable by Block size 8"):
        DenseSparsityConfig(num_heads=3, block=8).make_layout(41)


def test_fixed_layout_documented_defaults_bidirectional_is_symmetric_without_global():
    config = FixedSparsityConfig(num_heads=4)
    assert (config.block, config.num_local_blocks, config.num_global_blocks, config.attention) == (
        16, 4, 1, "bidirectional")
    layout = config.make_layout(2048)
    assert layout.shape == (4, 128, 128)
    assert all(torch.equal(layout[0], layout[h]) for h in range(4))
    cols = torch.nonzero(layout[0].all(dim=0)).flatten().tolist()
    assert cols == list(range(3, 128, 4))  # the last block of each 4-block window is global


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_local_blocks=4, num_global_blocks=3), "dividable by number of global blocks"),
    (dict(attention="sideways"), "uni/bi-directional"),
    (dict(attention="unidirectional", horizontal_global_attention=True), "horizontal global attention"),
    (dict(num_different_global_patterns=2), "different_layout_per_head to True"),
    (dict(different_layout_per_head=True, num_different_global_patterns=5), "cannot be larger"),
])
def test_fixed_config_errors(kwargs, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        FixedSparsityConfig(4, **kwargs)


def test_global_range_errors():
    with pytest.raises(ValueError, match="must be same as"):
        VariableSparsityConfig(1, global_block_indices=[0, 2], global_block_end_indices=[1])
    with pytest.raises(ValueError, match="must be smaller than global block end"):
        BSLongformerSparsityConfig(1, global_block_indices=[3], global_block_end_indices=[3])


def _replay_random(seed, heads, num_blocks, k, causal=False):
    random.seed(seed)
    out = []
    for _ in range(heads):
        out.append([random.sample(range(0, row + 1 if causal else num_blocks), k) for row in range(num_blocks)])
    return out


@pytest.mark.parametrize("attention, k", [("bidirectional", 2), ("unidirectional", 1)])
def test_bigbird_layout_replays_deepspeed_random_draws(attention, k):
    # unidirectional draws from the first row+1 blocks, so (as in DeepSpeed) k must not exceed 1
    config = BigBirdSparsityConfig(3, block=16, different_layout_per_head=True, num_random_blocks=k,
                                   num_sliding_window_blocks=3, num_global_blocks=1, attention=attention)
    random.seed(7)
    layout = config.make_layout(16 * 10)
    draws = _replay_random(7, 3, 10, k, causal=attention == "unidirectional")
    for h in range(3):
        expected = torch.zeros(10, 10, dtype=torch.int64)
        for row, cols in enumerate(draws[h]):
            expected[row, cols] = 1
            expected[row, max(0, row - 1):row + 2] = 1
        expected[0, :] = 1
        expected[:, 0] = 1
        if attention == "unidirectional":
            expected = torch.tril(expected)
        assert torch.equal(layout[h], expected), f"head {h}:\n{layout[h]}\n{expected}"


def test_variable_random_blocks_replay_and_single_layout_is_shared():
    config = VariableSparsityConfig(2, num_random_blocks=1, local_window_blocks=[4], global_block_indices=[0])
    random.seed(3)
    layout = config.make_layout(128)
    (draws,) = _replay_random(3, 1, 8, 1)
    expected = torch.zeros(8, 8, dtype=torch.int64)
    for row, cols in enumerate(draws):
        expected[row, cols] = 1
    expected[:4, :4] = 1
    expected[4:, 4:] = 1
    expected[:, 0] = 1
    assert torch.equal(layout[0], expected) and torch.equal(layout[1], expected)


def test_base_config_has_no_pattern():
    with pytest.raises(NotImplementedError, match="has no pattern"):
        SparsityConfig(num_heads=4).make_layout(64)


# ---- sparse self-attention ------------------------------------------------------------------------------------


def _dense_reference(q, k, v, layout, block, additive=None):
    """Dense attention with every (query, key) outside the layout's blocks masked, built block by block."""
    L = q.shape[-2]
    allowed = torch.zeros(layout.shape[0], L, L, dtype=torch.bool)
    for h, r, c in layout.nonzero().tolist():
        allowed[h, r * block:(r + 1) * block, c * block:(c + 1) * block] = True
    bias = torch.zeros(q.shape[0], layout.shape[0], L, L, dtype=torch.float64)
    if additive is not None:
        bias = bias + additive
    bias = bias.masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


CONFIGS = {
    "fixed": lambda: FixedSparsityConfig(4, block=8, num_local_blocks=2),
    "bigbird": lambda: BigBirdSparsityConfig(4, block=8, different_layout_per_head=True),
    "bslongformer": lambda: BSLongformerSparsityConfig(4, block=8),
    "variable_uni": lambda: VariableSparsityConfig(4, block=8, local_window_blocks=[2], attention="unidirectional"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sparse_attention_equals_dense_attention_under_the_layout(name):
    torch.manual_seed(0)
    random.seed(0)
    attn = SparseSelfAttention(CONFIGS[name](), max_seq_length=128)
    q, k, v = (torch.randn(2, 4, 64, 16, dtype=torch.float64) for _ in range(3))
    out = attn(q, k, v)
    layout = attn.get_layout(64)
    assert torch.equal(layout, attn.master_layout[:, :8, :8])
    torch.testing.assert_close(out, _dense_reference(q, k, v, layout, 8))
    # keys given already transposed ([B, H, D, L]) are accepted, as in DeepSpeed
    torch.testing.assert_close(attn(q, k.transpose(-1, -2), v), out)


def test_dense_config_is_plain_attention_and_gradients_flow():
    torch.manual_seed(0)
    attn = SparseSelfAttention(DenseSparsityConfig(2, block=16), max_seq_length=64)
    q, k, v = (torch.randn(1, 2, 32, 8, requires_grad=True) for _ in range(3))
    out = attn(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_masks_rpe_and_modes():
    torch.manual_seed(1)
    config = FixedSparsityConfig(2, block=8, num_local_blocks=2)
    q, k, v = (torch.randn(2, 2, 32, 8, dtype=torch.float64) for _ in range(3))
    keep = torch.ones(2, 32, dtype=torch.float64)
    keep[1, 20:] = 0
    attn_mask = torch.tril(torch.ones(32, 32, dtype=torch.float64))
    rpe = torch.randn(2, 2, 32, 32, dtype=torch.float64)
    layout = config.make_layout(32)
    causal_add = torch.zeros(32, 32, dtype=torch.float64).masked_fill(attn_mask == 0, float("-inf"))
    pad_add = torch.zeros(2, 32, dtype=torch.float64).masked_fill(keep == 0, float("-inf"))
    expected = _dense_reference(q, k, v, layout, 8, rpe + causal_add + pad_add[:, None, None, :])

    mul = SparseSelfAttention(config, key_padding_mask_mode="mul", attn_mask_mode="mul", max_seq_length=32)
    torch.testing.assert_close(mul(q, k, v, rpe=rpe, key_padding_mask=keep, attn_mask=attn_mask), expected)
    add = SparseSelfAttention(config, key_padding_mask_mode="add", attn_mask_mode="add", max_seq_length=32)
    # BERT's extended mask [B, 1, 1, L] is squeezed to [B, L]
    got = add(q, k, v, rpe=rpe, key_padding_mask=pad_add[:, None, None, :], attn_mask=causal_add)
    torch.testing.assert_close(got, expected)


def test_attention_errors():
    attn = SparseSelfAttention(FixedSparsityConfig(2, block=8), max_seq_length=64)
    q = torch.randn(1, 2, 24, 4)
    with pytest.raises(NotImplementedError, match="only self-attention"):
        attn(q, q, torch.randn(1, 2, 24, 8))
    with pytest.raises(ValueError, match="dividable by Block size 8"):
        attn(*(torch.randn(1, 2, 20, 4) for _ in range(3)))
    with pytest.raises(ValueError, match="longer than max_seq_length"):
        attn(*(torch.randn(1, 2, 72, 4) for _ in range(3)))
    with pytest.raises(ValueError, match="'add' or 'mul'"):
        SparseSelfAttention(FixedSparsityConfig(2), attn_mask_mode="max")


def test_bert_sparse_self_attention_shapes():
    config = types.SimpleNamespace(hidden_size=32, num_attention_heads=4, max_position_embeddings=64)
    layer = BertSparseSelfAttention(config, FixedSparsityConfig(4, block=8))
    out = layer(torch.randn(2, 32, 32), torch.zeros(2, 1, 1, 32))
    assert out.shape == (2, 32, 32)
    with pytest.raises(ValueError, match="not a multiple"):
        BertSparseSelfAttention(types.SimpleNamespace(hidden_size=30, num_attention_heads=4))


# ---- utilities ------------------------------------------------------------------------------------------------


def test_pad_and_unpad():
    ids = torch.arange(10).view(2, 5)
    mask = torch.ones(2, 5, dtype=torch.long)
    types_ = torch.ones(2, 5, dtype=torch.long)
    pos = torch.arange(5).expand(2, 5)
    pad_len, ids2, mask2, types2, pos2, embeds = SparseAttentionUtils.pad_to_block_size(
        8, ids, mask, types_, pos, None, pad_token_id=0, model_embeddings=None)
    assert pad_len == 3 and embeds is None
    assert ids2.shape == mask2.shape == types2.shape == pos2.shape == (2, 8)
    assert ids2[:, 5:].eq(0).all() and mask2[:, 5:].eq(0).all() and types2[:, 5:].eq(0).all()
    emb = torch.nn.Embedding(4, 6)
    pad_len, _, _, _, _, embeds = SparseAttentionUtils.pad_to_block_size(
        4, None, mask, types_, None, torch.randn(2, 5, 6), pad_token_id=1, model_embeddings=emb)
    assert pad_len == 3 and embeds.shape == (2, 8, 6)
    torch.testing.assert_close(embeds[:, 5:], emb(torch.ones(2, 3, dtype=torch.long)))
    assert SparseAttentionUtils.unpad_sequence_output(3, embeds).shape == (2, 5, 6)
    assert SparseAttentionUtils.unpad_sequence_output(0, embeds) is embeds
    assert SparseAttentionUtils.pad_to_block_size(5, ids, mask, types_, pos, None, 0, None)[1] is ids


def test_update_tokenizer_model_max_length():
    tok = types.SimpleNamespace(model_max_length=512, init_kwargs={})
    assert SparseAttentionUtils.update_tokenizer_model_max_length(tok, 4096) is tok
    assert tok.model_max_length == 4096 and tok.init_kwargs["model_max_length"] == 4096


def _tiny(kind):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(max_position_embeddings=64, **common)).eval()
    config = transformers.RobertaConfig(max_position_embeddings=66, pad_token_id=1, **common)
    return transformers.RobertaForMaskedLM(config).eval()


def test_extend_position_embedding_bert_and_roberta():
    bert = _tiny("bert")
    old = bert.bert.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(bert, 128)
    new = bert.bert.embeddings.position_embeddings.weight
    assert new.shape == (128, 32) and torch.equal(new[64:], old) and bert.config.max_position_embeddings == 128
    bert(input_ids=torch.randint(2, 50, (1, 100)))  # the longer positions are usable

    roberta = _tiny("roberta")
    old = roberta.roberta.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(roberta, 128)
    new = roberta.roberta.embeddings.position_embeddings.weight
    assert new.shape == (130, 32) and roberta.config.max_position_embeddings == 130
    assert torch.equal(new[2:66], old[2:]) and torch.equal(new[66:], old[2:]) and torch.equal(new[:2], old[:2])
    with pytest.raises(ValueError, match="only supports"):
        SparseAttentionUtils.extend_position_embedding(torch.nn.Linear(2, 2), 10)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_replace_self_attention_in_hf_model(kind):
    model = _tiny(kind)
    ids = torch.randint(2, 50, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 24:] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 64, DenseSparsityConfig(num_heads=4, block=16))
    base = getattr(model, kind)
    assert all(type(layer.attention.self).__name__ == "HFBertSparseSelfAttention" for layer in base.encoder.layer)
    assert model.config.max_position_embeddings == (64 if kind == "bert" else 66)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    # a dense layout is exact attention: same logits where tokens are not padding
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1, :24], expected[1, :24], atol=1e-5, rtol=1e-4)
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 64, FixedSparsityConfig(num_heads=4, block=16))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, attention_mask=mask).logits).all()


def test_served_at_deepspeed_ops_sparse_attention():
    import deepspeed.ops.sparse_attention as sa
    import ds_ops.sparse_attention as provider
    from deepspeed.ops.sparse_attention.sparsity_config import FixedSparsityConfig as Fixed

    assert sa is provider and Fixed is FixedSparsityConfig
    for name in ("SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
                 "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
                 "SparseSelfAttention", "BertSparseSelfAttention", "SparseAttentionUtils"):
        assert hasattr(sa, name)

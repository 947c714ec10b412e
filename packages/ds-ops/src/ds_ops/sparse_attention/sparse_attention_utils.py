"""Helpers to put sparse self-attention into pretrained BERT/RoBERTa-style models (Hugging Face layout).

Models are duck-typed: ``model.bert`` / ``model.roberta`` with ``embeddings.position_embeddings`` and
``encoder.layer[i].attention.self`` holding ``query``/``key``/``value`` linears, as Hugging Face's models.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .bert_sparse_self_attention import HFBertSparseSelfAttention
from .sparsity_config import SparsityConfig


def _base_model(model, what: str):
    for name in ("bert", "roberta"):
        if hasattr(model, name):
            return name, getattr(model, name)
    raise ValueError(f'Please extend "{what}" function to support your model type. It currently only supports '
                     '"bert" & "roberta"!')


class SparseAttentionUtils:
    """Extend position embeddings, swap self-attention for sparse self-attention, pad to the block size."""

    @staticmethod
    def extend_position_embedding(model, max_position):
        """Grow the position embedding of a checkpointed model to ``max_position`` by tiling the learned rows.

        RoBERTa keeps its two reserved rows (padding offset) in front, so its table gets ``max_position + 2`` rows.
        """
        kind, base = _base_model(model, "extend_position_embedding")
        emb = base.embeddings.position_embeddings
        if kind == "bert":
            original_max_position = emb.weight.size(0)
            if max_position <= original_max_position:
                raise ValueError(f"max_position {max_position} must exceed the current {original_max_position}")
            extend_multiples = max(1, max_position // original_max_position)
            emb.weight.data = emb.weight.data.repeat(extend_multiples, 1)
        else:
            original_max_position, embed_size = emb.weight.shape
            original_max_position -= 2
            if max_position <= original_max_position:
                raise ValueError(f"max_position {max_position} must exceed the current {original_max_position}")
            extend_multiples = max(1, max_position // original_max_position)
            max_position += 2
            extended = emb.weight.data.new_empty(max_position, embed_size)
            extended[:2] = emb.weight.data[:2]
            k = 2
            for _ in range(extend_multiples):
                extended[k:k + original_max_position] = emb.weight.data[2:]
                k += original_max_position
            emb.weight.data = extended
        emb.num_embeddings = emb.weight.size(0)
        _extend_position_buffers(base.embeddings, emb.weight.size(0))
        model.config.max_position_embeddings = max_position
        print(f'Extended position embeddings to {original_max_position * extend_multiples}')
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer, max_position):
        """Set the tokenizer's ``model_max_length`` (and its saved init kwargs) to ``max_position``."""
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs['model_max_length'] = max_position
        print(f'updated tokenizer model max imum length to {max_position}')
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
            model, max_position, sparsity_config=SparsityConfig(num_heads=4)):  # noqa: B008
        """Replace every encoder layer's self-attention of a BERT/RoBERTa model with sparse self-attention."""
        kind, base = _base_model(model, "update_model_self_attention_to_sparse_self_attention")
        model.config.max_position_embeddings = max_position + (2 if kind == "roberta" else 0)
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, base.encoder.layer, sparsity_config)
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
            config, layers, sparsity_config=SparsityConfig(num_heads=4)):  # noqa: B008
        """Swap ``layer.attention.self`` of each layer for a sparse one that reuses its query/key/value linears."""
        for layer in layers:
            old = layer.attention.self
            sparse = HFBertSparseSelfAttention(config, sparsity_config)
            sparse.query, sparse.key, sparse.value = old.query, old.key, old.value
            sparse.to(device=old.query.weight.device)
            layer.attention.self = sparse
        return layers

    @staticmethod
    def pad_to_block_size(block_size, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          pad_token_id, model_embeddings):
        """Pad the inputs on the sequence dimension to a multiple of ``block_size``.

        Returns ``(pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)``; padded
        tokens are ``pad_token_id`` (embedded with ``model_embeddings`` when ``inputs_embeds`` is given), masked out,
        token type 0. Call ``unpad_sequence_output(pad_len, ...)`` on the encoder output.
        """
        batch_size, seq_len = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len > 0:
            if inputs_embeds is not None:
                pad_input_ids = inputs_embeds.new_full((batch_size, pad_len), pad_token_id, dtype=torch.long)
                inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_input_ids)], dim=-2)
            if input_ids is not None:
                input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
            if position_ids is not None:
                position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (0, pad_len), value=False)
            if token_type_ids is not None:
                token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len, sequence_output):
        """Drop the ``pad_len`` positions ``pad_to_block_size`` added from ``[batch, seq, ...]`` output."""
        if pad_len > 0:
            sequence_output = sequence_output[:, :-pad_len]
        return sequence_output


def _extend_position_buffers(embeddings, num_positions: int) -> None:
    """Hugging Face embeddings keep ``position_ids``/``token_type_ids`` buffers sized to the old maximum."""
    ids = getattr(embeddings, "position_ids", None)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.size(1) < num_positions:
        embeddings.position_ids = torch.arange(num_positions, device=ids.device).expand(1, -1)
    types = getattr(embeddings, "token_type_ids", None)
    if isinstance(types, torch.Tensor) and types.dim() == 2 and types.size(1) < num_positions:
        embeddings.token_type_ids = torch.zeros((1, num_positions), dtype=types.dtype, device=types.device)

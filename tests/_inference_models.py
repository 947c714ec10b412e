"""Tiny randomly initialised Hugging Face models for the inference tests (built from configs: no download).

Every builder seeds torch first, so each rank of a multi-rank test builds the same weights. Sizes are picked so
AutoTP can split them over 2 ranks (heads and widths divisible by 2) and the Linear weights dominate the bytes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logging.getLogger("transformers").setLevel(logging.ERROR)  # tiny vocabularies make it warn about token ids


def tiny_gpt2(seed: int = 0, hidden: int = 64, vocab: int = 96) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=hidden, n_layer=2, n_head=4, bos_token_id=0,
                     eos_token_id=1, pad_token_id=1)
    return GPT2LMHeadModel(cfg).eval()


def tiny_llama(seed: int = 0, hidden: int = 64, vocab: int = 96) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0,
                      eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def tiny_bert(seed: int = 0, hidden: int = 64, vocab: int = 96) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=32, pad_token_id=1)
    return BertForMaskedLM(cfg).eval()


BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}
GENERATIVE = ("gpt2", "llama")


def token_ids(batch: int = 2, length: int = 8, vocab: int = 96, seed: int = 1) -> torch.Tensor:
    """Token ids that avoid the special ids 0 and 1 (so greedy decoding does not stop early on eos)."""
    return torch.randint(2, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))

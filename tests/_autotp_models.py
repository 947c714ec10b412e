"""Tiny random Hugging Face models (built from small configs, nothing downloaded) for the AutoTP tests."""

from __future__ import annotations

import torch


def tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 model in eval mode: ``gpt2`` (Conv1D, fused c_attn, tied head), ``llama`` (GQA, 4 heads /
    2 kv heads), ``bert`` (post-LayerNorm encoder)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = tf.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               bos_token_id=None, eos_token_id=None)
        model = tf.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = tf.LlamaForCausalLM(config)
    elif kind == "bert":
        config = tf.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        model = tf.BertModel(config, add_pooling_layer=True)
    else:
        raise ValueError(kind)
    config._attn_implementation = "eager"
    return model.float().eval()


def ids(batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))


def output(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=tokens, use_cache=False) if hasattr(model.config, "use_cache") else model(tokens)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def without_tp_plan(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with no Hugging Face tp_plan anywhere (config, instance, class: DeepSpeed merges the three), so
    AutoTP falls back to its heuristics. The class plan is cleared on a per-instance subclass, not on the shared
    transformers class."""
    model.config.base_model_tp_plan = None
    model._tp_plan = {}
    cls = type(model)
    model.__class__ = type(cls.__name__, (cls,), {"_tp_plan": None, "__module__": cls.__module__})
    return model

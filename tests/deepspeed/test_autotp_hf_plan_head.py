"""AutoTP training with the whole Hugging Face tp_plan (``_get_hf_tp_plan``: the config's base plan, the model
class's ``lm_head`` entry, the instance's ``embedding_rowwise``): a tiny Qwen2 through ``deepspeed.initialize`` on 2
ranks gives the unsharded model's logits and loss, with an untied head gathered over an uneven vocabulary and with
a tied head split along the vocabulary together with its embedding; the tied model's checkpoint round-trips."""

from __future__ import annotations

import torch
from _harness import run_distributed

VOCAB = 101  # odd: shards of 51 and 50 rows


def _qwen2(tied: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config).float()


def _initialize(tied: bool):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 2}}
    return deepspeed.initialize(model=_qwen2(tied), config=config)[0]


def _run(tied: bool, save_dir: str) -> dict:
    from ds_inference.autotp import full_state_dict

    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = _qwen2(tied)(input_ids=tokens, labels=tokens)
    engine = _initialize(tied)
    model = engine.module
    out = engine(input_ids=tokens, labels=tokens)
    facts = {"types": (type(model.model.embed_tokens).__name__, type(model.lm_head).__name__),
             "shapes": (tuple(model.model.embed_tokens.weight.shape), tuple(model.lm_head.weight.shape)),
             "shared": model.lm_head.weight is model.model.embed_tokens.weight,
             "logits": torch.allclose(out.logits, reference.logits, atol=1e-5),
             "loss": abs(out.loss.item() - reference.loss.item()) < 1e-5}
    engine.backward(out.loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    trained = full_state_dict(model)
    fresh = _initialize(tied)
    fresh.load_checkpoint(save_dir, tag="t")
    facts["round_trip"] = all(torch.equal(v, full_state_dict(fresh.module)[k]) for k, v in trained.items())
    return facts


def test_untied_head_is_gathered_over_an_uneven_vocabulary(tmp_path):
    results = run_distributed(_run, world_size=2, args=(False, str(tmp_path)), timeout=180)
    for rank, facts in enumerate(results):
        # the class plan's lm_head entry (colwise_gather_output) shards the head; embedding_rowwise on an untied
        # embedding keeps it whole, as DeepSpeed does
        assert facts["types"] == ("Embedding", "LinearLayer")
        assert facts["shapes"] == ((VOCAB, 32), ((51, 32), (50, 32))[rank])
        assert not facts["shared"] and facts["logits"] and facts["loss"] and facts["round_trip"]


def test_tied_head_and_embedding_share_one_vocabulary_shard(tmp_path):
    results = run_distributed(_run, world_size=2, args=(True, str(tmp_path)), timeout=180)
    for rank, facts in enumerate(results):
        assert facts["types"] == ("VocabParallelEmbedding", "LinearLayer")
        assert facts["shapes"] == (((51, 32),) * 2, ((50, 32),) * 2)[rank]
        assert facts["shared"] and facts["logits"] and facts["loss"] and facts["round_trip"]

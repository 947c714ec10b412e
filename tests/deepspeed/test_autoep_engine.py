"""AutoEP through ``deepspeed.initialize``: a tiny random Mixtral with ``expert_parallel: {enabled, autoep_size: 2}``
on 2 gloo ranks trains to the same losses as the unreplaced model in the plain engine (each rank its own batch)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

transformers = pytest.importorskip("transformers")

STEPS = 3


def _mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(config)


def _train(autoep: bool) -> list[float]:
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    if autoep:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    engine, *_ = deepspeed.initialize(model=_mixtral(), config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 32, (2, 9), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    replaced = sum(type(m).__name__ == "AutoEPMoELayer" for m in engine.module.modules())
    return losses, replaced


def test_autoep_trains_like_the_unreplaced_model():
    plain = run_distributed(_train, world_size=2, args=(False,), timeout=120)
    sharded = run_distributed(_train, world_size=2, args=(True,), timeout=120)
    for (want, none), (got, replaced) in zip(plain, sharded, strict=True):
        assert none == 0 and replaced == 2
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)

"""``deepspeed.elasticity`` paths and elastic batch sizes through ``deepspeed.initialize`` (2 gloo ranks)."""

from __future__ import annotations

from _harness import run_distributed


def test_paths_import():
    from deepspeed.elasticity import ElasticityConfigError, compute_elastic_config, elasticity_enabled
    from deepspeed.elasticity.config import ElasticityConfig, ElasticityError, ElasticityIncompatibleWorldSize
    from deepspeed.elasticity.constants import LATEST_ELASTICITY_VERSION, MINIMUM_DEEPSPEED_VERSION
    from deepspeed.elasticity.elasticity import compute_elastic_config as same

    assert same is compute_elastic_config and LATEST_ELASTICITY_VERSION == 0.2 and MINIMUM_DEEPSPEED_VERSION
    assert issubclass(ElasticityConfigError, ElasticityError) and issubclass(ElasticityIncompatibleWorldSize,
                                                                            ElasticityError)
    assert elasticity_enabled({"elasticity": {"enabled": True}}) and not elasticity_enabled({})
    assert ElasticityConfig({"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [2]}).micro_batches


def _init() -> tuple[int, int, int]:
    import torch

    import deepspeed

    cfg = {"elasticity": {"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [2, 4]},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 4), config=cfg)
    return (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps())


def test_initialize_picks_the_elastic_batch_for_the_world_size():
    # 2 data-parallel ranks: 96 = 4 (micro) x 12 (accumulation) x 2, as compute_elastic_config(..., world_size=2)
    assert run_distributed(_init, world_size=2, timeout=120) == [(96, 4, 12)] * 2

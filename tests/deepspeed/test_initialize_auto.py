"""deepspeed.initialize() refuses a config whose "auto" values nobody filled in (Hugging Face fills them first)."""

import pytest
import torch

import deepspeed
from ds_config import ConfigError


def test_unresolved_auto_values_are_named():
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
    }
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError) as info:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert "train_batch_size" in info.value.paths
    assert "optimizer.params.lr" in info.value.paths
    assert "auto" in str(info.value)

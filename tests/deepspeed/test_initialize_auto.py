"""deepspeed.initialize() refuses a config whose "auto" values nobody filled in (Hugging Face fills them first)."""

from _harness import run_distributed


def _initialize_with_auto_values() -> tuple[list[str], str]:
    import torch

    import deepspeed
    from ds_config import ConfigError

    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
    }
    model = torch.nn.Linear(2, 1)
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ConfigError as exc:
        return exc.paths, str(exc)
    return [], "no error"


def test_unresolved_auto_values_are_named():
    paths, message = run_distributed(_initialize_with_auto_values, world_size=1, timeout=60)[0]
    assert "train_batch_size" in paths
    assert "optimizer.params.lr" in paths
    assert "auto" in message

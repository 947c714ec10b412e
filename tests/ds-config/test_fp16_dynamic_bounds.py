"""``fp16.loss_scale_window`` / ``min_loss_scale`` are checked only while the loss scale is dynamic (fp16 on,
``loss_scale`` 0), as DeepSpeed; ``loss_scale`` itself must be a number."""

from __future__ import annotations

import pytest

from ds_config import ConfigError, load_config
from ds_config.precision import FP16Config


@pytest.mark.parametrize("key", ["loss_scale_window", "min_loss_scale"])
@pytest.mark.parametrize("value", [0, -1])
def test_bounds_apply_only_to_a_dynamic_scale(key, value):
    assert getattr(FP16Config(enabled=True, loss_scale=128, **{key: value}), key) == value
    assert getattr(FP16Config(enabled=False, **{key: value}), key) == value
    with pytest.raises(ConfigError, match=rf"fp16.{key} must be > 0 when dynamic loss scaling is on"):
        load_config({"train_batch_size": 2, "fp16": {"enabled": True, key: value}})


@pytest.mark.parametrize("bad", [[], {}, True])
def test_loss_scale_must_be_a_number(bad):
    with pytest.raises(ValueError, match="must be a number"):
        FP16Config(loss_scale=bad)

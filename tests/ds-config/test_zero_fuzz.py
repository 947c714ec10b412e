"""Property tests: random values in the zero, inference and monitor sections either validate or raise a
ConfigError whose every path lies inside the section; nothing else ever escapes."""

from __future__ import annotations

import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_config._base import validate_section
from ds_config._errors import ConfigError
from ds_config.inference import DeepSpeedInferenceConfig
from ds_config.monitor import DeepSpeedMonitorConfig
from ds_config.zero import DeepSpeedZeroConfig

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(allow_nan=True),
                    st.sampled_from(["auto", "cpu", "nvme", "none", "", "fp16", "get", "x" * 3]))
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                       max_leaves=6)


def _keys(cls) -> list[str]:
    return sorted(cls.known_keys()) + ["bogus_key"]


def _section(cls):
    return st.dictionaries(st.sampled_from(_keys(cls)), JSONISH, max_size=4)


def _check(cls, data, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            validate_section(cls, data, path=path)
        except ConfigError as err:
            assert err.problems
            assert all(p == path or p.startswith(path + ".") for p in err.paths), err.paths


FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(_section(DeepSpeedZeroConfig), st.sampled_from([0, 1, 2, 3, "auto", 3.0, 7]))
def test_zero_random_sections(data, stage):
    _check(DeepSpeedZeroConfig, {"stage": stage, **data}, "zero_optimization")


@FAST
@given(st.dictionaries(st.sampled_from(["offload_param", "offload_optimizer", "leaf_module", "zenflow"]),
                       st.dictionaries(st.sampled_from(["device", "nvme_path", "buffer_count", "ratio", "classes",
                                                        "topk_ratio", "select_strategy", "pin_memory", "nope"]),
                                       JSONISH, max_size=3), max_size=3))
def test_zero_random_sub_sections(data):
    _check(DeepSpeedZeroConfig, {"stage": 3, **data}, "zero_optimization")


@FAST
@given(_section(DeepSpeedInferenceConfig))
def test_inference_random_sections(data):
    _check(DeepSpeedInferenceConfig, data, "inference")


@FAST
@given(st.dictionaries(st.sampled_from(["tensorboard", "wandb", "comet", "csv_monitor", "other"]),
                       st.one_of(JSONISH, st.dictionaries(st.sampled_from(["enabled", "api_key", "mode", "project",
                                                                          "samples_log_interval", "zz"]),
                                                          JSONISH, max_size=3)), max_size=3))
def test_monitor_random_sections(data):
    _check(DeepSpeedMonitorConfig, data, "monitor")

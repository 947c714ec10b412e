"""Monitor configs: values, the combined ``enabled``, errors with paths, and the Comet API key kept secret."""

from __future__ import annotations

import json
import warnings

import pytest
from pydantic import SecretStr

from ds_config._base import UnknownConfigKeyWarning, validate_section
from ds_config._errors import ConfigError
from ds_config.monitor import CometConfig, CSVConfig, DeepSpeedMonitorConfig, TensorBoardConfig, WandbConfig

SECRET = "sk-very-secret-comet-key-0123456789"


def monitor(data, **kw) -> DeepSpeedMonitorConfig:
    return validate_section(DeepSpeedMonitorConfig, data, **kw)


def test_documented_comet_example():
    cfg = validate_section(CometConfig, {"enabled": True, "project": "my_project", "samples_log_interval": 50,
                                         "experiment_name": "llama-fine-tuning",
                                         "experiment_key": "0c4a1c4a90664f2a8084e600b19a9d7",
                                         "online": False, "mode": "get"}, path="comet")
    assert cfg.samples_log_interval == 50 and cfg.mode == "get" and cfg.online is False


def test_each_monitor_section():
    cfg = monitor({"tensorboard": {"enabled": True, "output_path": "/logs", "job_name": "run1"},
                   "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
                   "csv_monitor": {"enabled": True, "output_path": "/csv"}})
    assert isinstance(cfg.tensorboard, TensorBoardConfig) and cfg.tensorboard.output_path == "/logs"
    assert isinstance(cfg.wandb, WandbConfig)
    assert (cfg.wandb.group, cfg.wandb.team, cfg.wandb.project) == ("g", "t", "p")
    assert isinstance(cfg.csv_monitor, CSVConfig) and cfg.csv_monitor.job_name == "DeepSpeedJobName"


@pytest.mark.parametrize("section", ["tensorboard", "wandb", "comet", "csv_monitor"])
def test_enabled_is_any_section_enabled(section):
    assert monitor({}).enabled is False
    assert monitor({section: {"enabled": True}}).enabled is True
    assert monitor({section: {"enabled": False}}).enabled is False


def test_auto_means_default():
    cfg = monitor({"wandb": {"project": "auto"}, "comet": {"samples_log_interval": "auto"}})
    assert cfg.wandb.project == "deepspeed" and cfg.comet.samples_log_interval == 100


@pytest.mark.parametrize("data,path,words", [
    ({"tensorboard": {"enabled": "true"}}, "tensorboard.enabled", "boolean"),
    ({"tensorboard": {"output_dir": "/x"}}, "tensorboard.output_dir", "did you mean 'output_path'"),
    ({"wandb": {"projct": "x"}}, "wandb.projct", "did you mean 'project'"),
    ({"comet": {"mode": "append"}}, "comet.mode", "'get', 'create' or 'get_or_create'"),
    ({"comet": {"samples_log_interval": 0}}, "comet.samples_log_interval", "greater than or equal to 1"),
    ({"csv_monitor": {"job_name": 3}}, "csv_monitor.job_name", "string"),
])
def test_errors_name_the_full_key_path(data, path, words):
    with pytest.raises(ConfigError) as info:
        monitor(data)
    assert path in info.value.paths and words in str(info.value)


def test_api_key_is_readable_but_never_shown():
    cfg = monitor({"comet": {"enabled": True, "api_key": SECRET}})
    key = cfg.comet.api_key
    assert isinstance(key, SecretStr) and key.get_secret_value() == SECRET
    for text in (repr(cfg), str(cfg), repr(cfg.comet), str(cfg.comet), str(key),
                 cfg.model_dump_json(), json.dumps(cfg.model_dump(mode="json"))):
        assert SECRET not in text


def test_api_key_absent_from_errors_in_the_same_section():
    with pytest.raises(ConfigError) as info:
        monitor({"comet": {"api_key": SECRET, "mode": "wrong", "workspce": "w"}})
    assert SECRET not in str(info.value) and SECRET not in repr(info.value.problems)
    assert set(info.value.paths) >= {"comet.workspce"}


@pytest.mark.parametrize("bad_key", [12345678901234, ["sk", "secret-part"], {"k": "secret-part"}])
def test_malformed_api_key_is_masked_in_the_error(bad_key):
    with pytest.raises(ConfigError) as info:
        validate_section(CometConfig, {"api_key": bad_key}, path="comet")
    text = str(info.value) + repr(info.value.problems)
    assert info.value.paths == ["comet.api_key"]
    assert "secret-part" not in text and "12345678901234" not in text and "**********" in text


def test_assigned_api_key_stays_secret():
    cfg = CometConfig()
    cfg.api_key = SECRET
    assert cfg.api_key.get_secret_value() == SECRET and SECRET not in repr(cfg)


def test_non_strict_mode_drops_unknown_keys_with_a_warning():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = monitor({"comet": {"enabled": True, "api_key": SECRET, "future": 1}}, strict=False)
    assert any(issubclass(w.category, UnknownConfigKeyWarning) and "comet.future" in str(w.message) for w in record)
    assert all(SECRET not in str(w.message) for w in record)
    assert cfg.comet.api_key.get_secret_value() == SECRET

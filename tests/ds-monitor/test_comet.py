"""Comet monitor: an offline experiment read back from its archive; the API key never leaks."""

from __future__ import annotations

import logging
import traceback

import pytest

from ds_config.monitor import CometConfig
from ds_monitor import CometMonitor, MonitorStartError

LOSS, LR = "Train/Samples/train_loss", "Train/Samples/lr"
SECRET = "cmt-SECRET-api-key-0123456789abcdef"


def _config(**kw) -> CometConfig:
    base = {"enabled": True, "online": False, "project": "proj", "workspace": "ws", "api_key": SECRET,
            "samples_log_interval": 100, "experiment_name": "llama-fine-tuning"}
    return CometConfig(**{**base, **kw})


def test_offline_archive_metrics_every_interval(comet_offline, read_comet, caplog):
    with caplog.at_level(logging.DEBUG):
        monitor = CometMonitor(_config(), rank=0)
        for step in range(0, 260, 50):  # 0, 50, ..., 250: due at 0, 100, 200 (interval 100 samples)
            monitor.write_events([(LOSS, 1000.0 / (step + 1), step), (LR, 0.01, step)])
        monitor.close()
    metrics, texts = read_comet(comet_offline)
    logged = [(m["metricName"], m["step"], m["metricValue"]) for m in metrics]
    assert [x for x in logged if x[0] == LOSS] == [(LOSS, s, pytest.approx(1000.0 / (s + 1))) for s in (0, 100, 200)]
    assert [x[1] for x in logged if x[0] == LR] == [0, 100, 200]
    assert any("llama-fine-tuning" in t for t in texts)  # the experiment name
    assert not any(SECRET in t for t in texts)
    assert SECRET not in caplog.text


def test_api_key_never_in_repr_or_str(comet_offline):
    monitor = CometMonitor(_config(), rank=0)
    try:
        for text in (repr(monitor), str(monitor), repr(monitor.monitor_config), str(monitor.monitor_config),
                     monitor.monitor_config.model_dump_json()):
            assert SECRET not in text
    finally:
        monitor.close()


def test_run_time_failure_is_redacted_warned_once_and_survived(comet_offline, caplog):
    monitor = CometMonitor(_config(samples_log_interval=1), rank=0)

    def refuse(name, value, step=None):
        raise ConnectionError(f"401 Unauthorized for api key {SECRET}")

    monitor.experiment.log_metric = refuse
    with caplog.at_level(logging.WARNING, logger="ds_monitor"):
        for step in range(3):
            monitor.write_events([(LOSS, 1.0, step)])
    monitor.close()
    records = [r for r in caplog.records if r.name == "ds_monitor"]
    assert monitor.failures == 3 and len(records) == 1
    assert "401 Unauthorized" in records[0].getMessage() and "**********" in records[0].getMessage()
    assert SECRET not in caplog.text


def test_start_failure_is_redacted_and_unchained(comet_offline, monkeypatch):
    import comet_ml

    def reject(**kwargs):
        assert kwargs["api_key"] == SECRET  # the real key reaches comet_ml, and only comet_ml
        raise ValueError(f"Invalid api key {kwargs['api_key']!r} for workspace ws")

    monkeypatch.setattr(comet_ml, "start", reject)
    with pytest.raises(MonitorStartError) as info:
        CometMonitor(_config(), rank=0)
    error = info.value
    assert "Invalid api key" in str(error) and "comet" in str(error)
    assert error.__cause__ is None and error.__context__ is None
    assert SECRET not in "".join(traceback.format_exception(error)) and SECRET not in repr(error)


def test_too_old_comet_ml_names_the_extra(comet_offline, monkeypatch):
    import comet_ml

    from ds_monitor import MonitorBackendMissing

    monkeypatch.delattr(comet_ml, "start")
    with pytest.raises(MonitorBackendMissing, match=r"too old .*pip install 'ds-monitor\[comet\]'"):
        CometMonitor(_config(), rank=0)


def test_mode_and_experiment_key_reach_comet(comet_offline):
    key = "0c4a1c4a90664f2a8084e600b19a9d7a"
    monitor = CometMonitor(_config(mode="get", experiment_key=key), rank=0)
    assert monitor.experiment.get_key() == key
    monitor.close()
    assert [p.name.startswith(key) for p in comet_offline.glob("*.zip")] == [True]

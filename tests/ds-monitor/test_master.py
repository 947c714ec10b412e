"""MonitorMaster: fan-out to every enabled monitor, rank 0 only, background writes, failures survived."""

from __future__ import annotations

import logging
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_config.monitor import DeepSpeedMonitorConfig
from ds_monitor import (
    MonitorBackendMissing,
    MonitorMaster,
    MonitorStartError,
    TensorBoardMonitor,
    normalize_events,
    resolve_rank,
)
from ds_monitor._dispatch import BackgroundWriter
from ds_monitor.utils import EventsLogScheduler

LOSS, LR = "Train/Samples/train_loss", "Train/Samples/lr"
EVENTS = [[(LOSS, 2.0, 16), (LR, 0.1, 16)], [(LOSS, 1.0, 32), (LR, 0.05, 32)]]


def _files(tmp_path, **enabled) -> dict:
    return {"tensorboard": {"enabled": enabled.get("tensorboard", False), "output_path": str(tmp_path / "tb"),
                            "job_name": "job"},
            "csv_monitor": {"enabled": enabled.get("csv_monitor", False), "output_path": str(tmp_path / "csv"),
                            "job_name": "job"}}


def test_all_four_backends_get_every_event(tmp_path, wandb_offline, comet_offline, read_tensorboard, read_wandb,
                                           read_comet):
    config = {**_files(tmp_path, tensorboard=True, csv_monitor=True), "wandb": {"enabled": True, "project": "p"},
              "comet": {"enabled": True, "online": False, "samples_log_interval": 1}}
    master = MonitorMaster(config, rank=0)
    assert [m.section for m in master.monitors] == ["tensorboard", "wandb", "comet", "csv_monitor"]
    for events in EVENTS:
        master.write_events(events)
    assert master.flush()
    assert master.close()
    expected = {LOSS: [(16, 2.0), (32, 1.0)], LR: [(16, pytest.approx(0.1)), (32, pytest.approx(0.05))]}
    assert read_tensorboard(tmp_path / "tb" / "job") == expected
    csv_text = (tmp_path / "csv" / "job" / "Train_Samples_train_loss.csv").read_text()
    assert csv_text == "step,train_loss\n16,2.0\n32,1.0\n"
    assert read_wandb(wandb_offline)[1] == {16: {LOSS: 2.0, LR: 0.1}, 32: {LOSS: 1.0, LR: 0.05}}
    metrics, _ = read_comet(comet_offline)
    assert sorted((m["metricName"], m["step"], m["metricValue"]) for m in metrics) == sorted(
        (name, step, value) for events in EVENTS for name, value, step in events)
    master.write_events(EVENTS[0])  # after close: ignored, no error


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    config = _files(tmp_path, tensorboard=True, csv_monitor=True)
    monkeypatch.setenv("RANK", "1")
    for master in (MonitorMaster(config, rank=2), MonitorMaster(config)):  # explicit rank, then $RANK
        assert master.enabled and master.monitors == [] and master.rank in (1, 2)
        master.write_events(EVENTS[0])
        assert master.flush() and master.close()
    assert list(tmp_path.iterdir()) == []


def test_rank_resolution(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert resolve_rank() == 0 and resolve_rank(5) == 5
    monkeypatch.setenv("RANK", "3")
    assert resolve_rank() == 3 and resolve_rank(0) == 0
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(ValueError, match="RANK='three'"):
        resolve_rank()
    with pytest.raises(ValueError, match="rank=-1"):
        resolve_rank(-1)


@pytest.mark.parametrize(("section", "module", "extra"), [("tensorboard", "tensorboard", "tensorboard"),
                                                          ("wandb", "wandb", "wandb"), ("comet", "comet_ml", "comet")])
@pytest.mark.parametrize("rank", [0, 1])
def test_missing_package_names_the_extra(monkeypatch, section, module, extra, rank):
    monkeypatch.setitem(sys.modules, module, None)  # import fails and find_spec finds nothing, as if not installed
    with pytest.raises(MonitorBackendMissing, match=rf"pip install 'ds-monitor\[{extra}\]'") as info:
        MonitorMaster({section: {"enabled": True}}, rank=rank)
    assert f"'{section}.enabled'" in str(info.value) and info.value.name == module


def test_failing_backend_warns_once_and_the_others_keep_writing(tmp_path, caplog, read_tensorboard):
    master = MonitorMaster(_files(tmp_path, tensorboard=True, csv_monitor=True), rank=0)
    (tmp_path / "csv" / "job").rmdir()
    (tmp_path / "csv" / "job").write_text("not a directory")  # the CSV monitor now fails on every write
    with caplog.at_level(logging.WARNING, logger="ds_monitor"):
        for events in EVENTS:
            master.write_events(events)
        assert master.close()
    assert master.csv_monitor.failures == 2
    assert len([r for r in caplog.records if r.name == "ds_monitor"]) == 1
    assert read_tensorboard(tmp_path / "tb" / "job")[LOSS] == [(16, 2.0), (32, 1.0)]


def test_write_events_does_not_wait_for_a_stalled_backend(tmp_path):
    master = MonitorMaster(_files(tmp_path, csv_monitor=True), rank=0)
    release, written = threading.Event(), []
    original = master.csv_monitor._write

    def stalled(events):  # a backend stuck on a dead network share
        release.wait(10)
        original(events)
        written.append(events)

    master.csv_monitor._write = stalled
    start = time.perf_counter()
    for events in EVENTS:
        master.write_events(events)
    assert time.perf_counter() - start < 5 and written == []  # far below the backend's 10 s stall
    assert not master.flush(timeout=0.05)  # still stuck
    release.set()
    assert master.flush(timeout=10) and len(written) == 2
    master.close()


def test_full_queue_drops_with_one_warning(caplog):
    writer, gate, ran = BackgroundWriter(max_pending=2), threading.Event(), []
    with caplog.at_level(logging.WARNING, logger="ds_monitor"):
        results = [writer.submit(lambda i=i: (gate.wait(10), ran.append(i))) for i in range(6)]
    gate.set()
    assert writer.stop(10)
    assert results[:2] == [True, True] and writer.dropped == sum(not r for r in results) >= 3
    assert ran == [i for i, ok in enumerate(results) if ok]
    assert len([r for r in caplog.records if r.name == "ds_monitor"]) == 1


def test_malformed_events_raise_at_the_call(tmp_path):
    master = MonitorMaster(_files(tmp_path, csv_monitor=True), rank=0, background=False)
    with pytest.raises(ValueError, match=r"event_list\[0\]"):
        master.write_events([(LOSS, 1.0)])
    with pytest.raises(TypeError, match="value='high' is not a number"):
        master.write_events([(LOSS, "high", 1)])
    with pytest.raises(TypeError, match="step=1.5"):
        master.write_events([(LOSS, 1.0, 1.5)])
    master.write_events([(LOSS, 1, 1)])  # ints are numbers
    master.close()
    assert (tmp_path / "csv" / "job" / "Train_Samples_train_loss.csv").read_text() == "step,train_loss\n1,1.0\n"


def test_config_forms(tmp_path):
    typed = DeepSpeedMonitorConfig.model_validate(_files(tmp_path))
    assert MonitorMaster(typed).monitor_config is typed
    assert not MonitorMaster({}).enabled and MonitorMaster(None).monitors == []
    from ds_config import DeepSpeedConfig

    whole = DeepSpeedConfig.model_validate({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    master = MonitorMaster(whole, rank=1)
    assert master.enabled and master.monitor_config.csv_monitor is whole.csv_monitor
    with pytest.raises(TypeError, match="monitor_config=42"):
        MonitorMaster(42)


def test_events_log_scheduler():
    scheduler = EventsLogScheduler(100)
    due = [(name, s) for s in (0, 50, 99, 100, 150, 210) for name in ("a", "b") if scheduler.needs_logging(name, s)]
    assert due == [("a", 0), ("b", 0), ("a", 100), ("b", 100), ("a", 210), ("b", 210)]
    assert scheduler.needs_logging("a", 10)  # a restart from an earlier checkpoint logs again
    with pytest.raises(ValueError, match="samples_log_interval=0"):
        EventsLogScheduler(0)


def test_a_start_failure_closes_the_monitors_already_started(tmp_path, monkeypatch):
    closed = []
    monkeypatch.setattr(TensorBoardMonitor, "_close", lambda self: closed.append(self.log_dir))
    config = _files(tmp_path, tensorboard=True, csv_monitor=True)
    config["csv_monitor"]["job_name"] = "../escape"
    with pytest.raises(MonitorStartError, match="csv_monitor.job_name='../escape'"):
        MonitorMaster(config, rank=0)
    assert closed == [str(tmp_path / "tb" / "job")]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.text(max_size=5), st.integers()), st.one_of(st.floats(), st.integers(),
                                                                                   st.text(max_size=3), st.none()),
                          st.one_of(st.integers(), st.floats(), st.none())), max_size=4))
def test_normalize_events_accepts_exactly_name_number_int(events):
    def valid(name, value, step):
        return isinstance(name, str) and name != "" and not isinstance(value, (str, type(None))) \
            and isinstance(step, int)

    if all(valid(*e) for e in events):
        assert normalize_events(events) == [(n, float(v), s) for n, v, s in events]
    else:
        with pytest.raises((TypeError, ValueError), match=r"event_list\["):
            normalize_events(events)

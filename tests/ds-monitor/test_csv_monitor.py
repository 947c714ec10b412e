"""CSV monitor: one file per event, exact content, header once, append-safe across restarts."""

from __future__ import annotations

import csv
import logging
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_config import ConfigError
from ds_config.monitor import CSVConfig
from ds_monitor import CSVMonitor, MonitorStartError, csvMonitor
from ds_monitor.csv_monitor import csv_filename, csv_header

LOSS, LR = "Train/Samples/train_loss", "Train/Samples/lr"


def _monitor(root, rank=0) -> CSVMonitor:
    return CSVMonitor(CSVConfig(enabled=True, output_path=str(root), job_name="job"), rank=rank)


def test_one_file_per_event_with_exact_content(tmp_path):
    monitor = _monitor(tmp_path)
    monitor.write_events([(LOSS, 2.5, 8), (LR, 0.001, 8)])
    monitor.write_events([(LOSS, 1.25, 16), (LR, 0.0005, 16)])
    monitor.close()
    job = tmp_path / "job"
    assert sorted(p.name for p in job.iterdir()) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    assert (job / "Train_Samples_train_loss.csv").read_text() == "step,train_loss\n8,2.5\n16,1.25\n"
    assert (job / "Train_Samples_lr.csv").read_text() == "step,lr\n8,0.001\n16,0.0005\n"


def test_restart_appends_and_writes_the_header_once(tmp_path):
    first = _monitor(tmp_path)
    first.write_events([(LOSS, 3.0, 4)])
    first.close()
    second = _monitor(tmp_path)  # a new process after a restart
    second.write_events([(LOSS, 2.0, 8), (LOSS, 1.0, 12)])
    assert (tmp_path / "job" / "Train_Samples_train_loss.csv").read_text() == "step,train_loss\n4,3.0\n8,2.0\n12,1.0\n"


def test_a_row_torn_by_a_crash_is_ended_before_new_rows(tmp_path):
    path = tmp_path / "job" / "loss.csv"
    path.parent.mkdir()
    path.write_text("step,loss\n4,3.0\n8,2.")  # the previous process died mid-row
    _monitor(tmp_path).write_events([("loss", 1.5, 12)])
    rows = list(csv.reader(path.open()))
    assert rows == [["step", "loss"], ["4", "3.0"], ["8", "2."], ["12", "1.5"]]


def test_other_ranks_and_disabled_write_nothing(tmp_path):
    for monitor in (_monitor(tmp_path, rank=1), CSVMonitor({"output_path": str(tmp_path)}, rank=0)):
        monitor.write_events([(LOSS, 1.0, 1)])
        assert not monitor.active
    assert list(tmp_path.iterdir()) == []


def test_deepspeed_class_name_and_dict_config(tmp_path):
    assert csvMonitor is CSVMonitor
    monitor = csvMonitor({"enabled": True, "output_path": str(tmp_path), "job_name": "j"}, rank=0)
    assert monitor.log_dir == str(tmp_path / "j")
    with pytest.raises(ConfigError, match="csv_monitor.job_nam"):
        CSVMonitor({"enabled": True, "job_nam": "x"})
    with pytest.raises(MonitorStartError, match=r"csv_monitor.job_name='\.\./up'"):
        CSVMonitor({"enabled": True, "output_path": str(tmp_path), "job_name": "../up"}, rank=0)


def test_unwritable_directory_warns_once_and_does_not_raise(tmp_path, caplog):
    monitor = _monitor(tmp_path)
    shutil.rmtree(tmp_path / "job")
    (tmp_path / "job").write_text("a file where the directory was")  # every open() now fails
    with caplog.at_level(logging.WARNING, logger="ds_monitor"):
        for step in range(4):
            monitor.write_events([(LOSS, 1.0, step)])
    assert monitor.failures == 4
    assert len([r for r in caplog.records if r.name == "ds_monitor"]) == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(min_size=1, max_size=30), values=st.lists(st.floats(allow_nan=False), min_size=1, max_size=5))
def test_any_name_round_trips(tmp_path, name, values):
    filename = csv_filename(name)
    assert "/" not in filename and "\\" not in filename and filename.endswith(".csv")
    root = tmp_path / "prop"
    shutil.rmtree(root, ignore_errors=True)
    _monitor(root).write_events([(name, v, i) for i, v in enumerate(values)])
    with (root / "job" / filename).open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    header = csv_header(name)
    assert rows[0] == header and all(ch.isprintable() for ch in header[1])
    if name.rsplit("/", 1)[-1].isprintable():
        assert header[1] == name.rsplit("/", 1)[-1]
    assert [(int(s), float(v)) for s, v in rows[1:]] == list(enumerate(values))

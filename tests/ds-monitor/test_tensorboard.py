"""TensorBoard monitor: real event files, read back with tensorboard's EventAccumulator."""

from __future__ import annotations

import logging

import pytest

from ds_config.monitor import TensorBoardConfig
from ds_monitor import TensorBoardMonitor

pytest.importorskip("tensorboard")

LOSS, LR = "Train/Samples/train_loss", "Train/Samples/lr"


def _monitor(tmp_path, **kw) -> TensorBoardMonitor:
    cfg = TensorBoardConfig(enabled=True, output_path=str(tmp_path / "tb"), job_name="job1")
    return TensorBoardMonitor(cfg, **kw)


def test_events_read_back(tmp_path, read_tensorboard):
    monitor = _monitor(tmp_path, rank=0)
    assert monitor.log_dir == str(tmp_path / "tb" / "job1")
    monitor.write_events([(LOSS, 2.5, 8), (LR, 1e-3, 8)])
    monitor.write_events([(LOSS, 1.25, 16), (LR, 5e-4, 16)])
    monitor.close()
    scalars = read_tensorboard(tmp_path / "tb" / "job1")
    assert set(scalars) == {LOSS, LR}
    assert scalars[LOSS] == [(8, 2.5), (16, 1.25)]
    assert [s for s, _ in scalars[LR]] == [8, 16]
    assert scalars[LR][0][1] == pytest.approx(1e-3) and scalars[LR][1][1] == pytest.approx(5e-4)


def test_restart_adds_a_file_in_the_same_directory(tmp_path, read_tensorboard):
    first = _monitor(tmp_path, rank=0)
    first.write_events([(LOSS, 3.0, 4)])
    first.close()
    second = _monitor(tmp_path, rank=0)
    second.write_events([(LOSS, 2.0, 8)])
    second.close()
    assert len(list((tmp_path / "tb" / "job1").glob("events.out.tfevents.*"))) == 2
    assert read_tensorboard(tmp_path / "tb" / "job1")[LOSS] == [(4, 3.0), (8, 2.0)]


def test_empty_output_path_means_launch_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monitor = TensorBoardMonitor({"enabled": True}, rank=0)
    monitor.close()
    assert monitor.log_dir == str(tmp_path / "DeepSpeedJobName")
    assert list((tmp_path / "DeepSpeedJobName").glob("events.out.tfevents.*"))


def test_disabled_or_other_rank_writes_nothing(tmp_path):
    off = TensorBoardMonitor(TensorBoardConfig(output_path=str(tmp_path / "tb")), rank=0)
    other = _monitor(tmp_path, rank=3)
    for monitor in (off, other):
        monitor.write_events([(LOSS, 1.0, 1)])
        monitor.close()
        assert not monitor.active and monitor.log_dir is None
    assert not (tmp_path / "tb").exists()


def test_disk_failure_warns_once_and_keeps_going(tmp_path, caplog):
    monitor = _monitor(tmp_path, rank=0)

    def full_disk(event):
        raise OSError(28, "No space left on device")

    monitor.summary_writer.add_event = full_disk
    with caplog.at_level(logging.WARNING, logger="ds_monitor"):
        for step in range(3):
            monitor.write_events([(LOSS, 1.0, step)])
    assert monitor.failures == 3
    warnings = [r for r in caplog.records if r.name == "ds_monitor"]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
    assert "tensorboard" in warnings[0].getMessage()
    monitor.close()

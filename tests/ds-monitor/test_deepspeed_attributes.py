"""The attributes DeepSpeed's monitor classes carry (``output_path``, ``job_name``, W&B's ``group``/``team``/
``project``), read from the config section, given and defaulted."""

from __future__ import annotations

import pytest

from ds_config.monitor import CSVConfig, TensorBoardConfig, WandbConfig
from ds_monitor import CSVMonitor, TensorBoardMonitor, WandbMonitor


@pytest.mark.parametrize("monitor_cls, config_cls", [(CSVMonitor, CSVConfig), (TensorBoardMonitor, TensorBoardConfig)])
def test_file_monitors_expose_output_path_and_job_name(tmp_path, monitor_cls, config_cls):
    given = monitor_cls(config_cls(enabled=True, output_path=str(tmp_path), job_name="run7"), rank=1)
    assert (given.enabled, given.output_path, given.job_name) == (True, str(tmp_path), "run7")
    default = monitor_cls(config_cls(), rank=0)
    assert (default.enabled, default.output_path, default.job_name) == (False, "", "DeepSpeedJobName")


def test_wandb_monitor_exposes_group_team_and_project():
    given = WandbMonitor({"enabled": False, "group": "g", "team": "t", "project": "p"}, rank=0)
    assert (given.group, given.team, given.project) == ("g", "t", "p")
    default = WandbMonitor(WandbConfig(), rank=0)
    assert (default.enabled, default.group, default.team, default.project) == (False, None, None, "deepspeed")

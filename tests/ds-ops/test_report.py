"""ds_report lists the environment and every op's status."""

from __future__ import annotations

import io
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from ds_ops import report


def test_report_lists_environment_and_ops(native):
    out = io.StringIO()
    report.render(out)
    text = out.getvalue()
    for label in ("torch version", "CUDA available", "C++ compiler", "ninja", "CPU SIMD levels", "JIT cache"):
        assert label in text
    rows = {r[0]: r for r in report.op_rows()}
    assert rows["cpu_adam"][1] == "[OKAY]" and rows["cpu_adam"][2] == "cached"
    assert {"cpu_adagrad", "cpu_lion"} <= set(rows)
    assert report.main([]) == 0


def test_ds_report_console_script_is_declared_and_installed():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = Path(report.__file__).resolve().parents[2] / "pyproject.toml"
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert scripts["ds_report"] == "ds_ops.report:main"
    installed = {ep.name: ep for ep in entry_points(group="console_scripts")}
    assert "ds_report" in installed, "ds-ops is installed without its ds_report script; reinstall it"
    assert installed["ds_report"].load() is report.main

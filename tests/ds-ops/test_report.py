"""ds_report lists the environment and every op's status."""

from __future__ import annotations

import io

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

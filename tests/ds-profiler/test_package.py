"""Packaging: torch-only dependency, public surface, documented DeepSpeed paths."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ds_profiler

OURS = ("ds_config", "ds_ops", "ds_zero", "ds_pipe", "ds_moe", "ds_monitor", "ds_inference", "deepspeed")


def test_import_pulls_in_nothing_of_ours_and_no_dynamo():
    code = ("import sys, ds_profiler; print(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:])));"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *OURS], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "False"]


def test_declared_dependencies_are_torch_only():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = pathlib.Path(ds_profiler.__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert [dep.split(">")[0].split("=")[0].strip() for dep in project["dependencies"]] == ["torch"]


def test_public_surface():
    for name in ("FlopsProfiler", "get_model_profile", "number_to_string", "macs_to_string", "flops_to_string",
                 "params_to_string", "duration_to_string", "bytes_to_string"):
        assert hasattr(ds_profiler, name) and hasattr(ds_profiler.profiler, name)


def test_number_formatting():
    from ds_profiler import duration_to_string, flops_to_string, macs_to_string, number_to_string, params_to_string

    assert number_to_string(3_139_930_000_000) == "3.14 T"
    assert macs_to_string(2.5e9) == "2.5 GMACs"
    assert flops_to_string(81.9e12) == "81.9 TFLOPS"
    assert params_to_string(1.3e9) == "1.3 B"
    assert params_to_string(336_230_000) == "336.23 M"
    assert duration_to_string(0.07639) == "76.39 ms"
    assert duration_to_string(3.4e-5) == "34 us"
    assert number_to_string(1234, units="K", precision=1) == "1.2 K"
    with pytest.raises(ValueError, match="units"):
        number_to_string(1, units="X")


def test_served_at_documented_deepspeed_paths():
    from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
    from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler as Documented
    from deepspeed.profiling.flops_profiler.profiler import get_model_profile as documented_fn

    assert FlopsProfiler is Documented is ds_profiler.FlopsProfiler
    assert get_model_profile is documented_fn is ds_profiler.get_model_profile


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=1e15)))
def test_number_to_string_keeps_the_value_to_its_precision(value):
    from ds_profiler import number_to_string
    from ds_profiler._format import _UNITS

    number, _, unit = number_to_string(value).partition(" ")
    scale = _UNITS[unit]
    assert abs(float(number) * scale - value) <= 0.005 * scale + 1e-12
    assert unit == "" or 1 <= float(number) < 1000 or float(number) == 1000.0

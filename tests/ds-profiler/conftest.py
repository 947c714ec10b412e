"""Shared helpers for the ds-profiler tests: the tiny reference models and a one-call op counter."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ds_profiler import FlopsProfiler


def _load_tiny_models():
    path = pathlib.Path(__file__).with_name("tiny_models.py")
    spec = importlib.util.spec_from_file_location("ds_profiler_tiny_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny():
    """The module of reference models (TinyGPT2, TinyBert, SmallCNN)."""
    return _load_tiny_models()


class Fn(nn.Module):
    """Runs a plain function as a module's forward, so its ops are inside the profiled model."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def count(fn_or_module: Callable, *inputs) -> tuple[int, int]:
    """(MACs, FLOPs) of one forward of ``fn_or_module(*inputs)``."""
    model = fn_or_module if isinstance(fn_or_module, nn.Module) else Fn(fn_or_module)
    prof = FlopsProfiler(model)
    prof.start_profile()
    try:
        with torch.no_grad():
            model(*inputs)
        return prof.get_total_macs(), prof.get_total_flops()
    finally:
        prof.end_profile()


@pytest.fixture(name="count")
def count_fixture():
    """``count(fn_or_module, *inputs) -> (macs, flops)``."""
    return count

"""Shared pytest set-up for every package's tests.

The multi-rank harness lives in ``tests/_harness`` (``pytest.ini`` puts ``tests/`` on ``sys.path``): write
``from _harness import run_distributed, distributed_test`` in a test module; its docstring has the
details. Its pytest plugin (fixture ``distributed``, forkserver warm-up, worker shutdown at session end) is
imported here. This file also skips GPU tests on machines without CUDA.
"""

from __future__ import annotations

import pytest
from _harness.plugin import distributed, pytest_itemcollected, pytest_sessionfinish

__all__ = ["distributed", "pytest_itemcollected", "pytest_sessionfinish"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return  # torch is imported only when a GPU test was collected
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)

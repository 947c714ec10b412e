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


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A test that initialises torch.distributed in the pytest process itself (instead of through the
    harness) must tear it down: a leftover default group changes what later tests see (ranks, world size)."""
    yield
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group initialised in the pytest process; "
                    "run multi-rank code through _harness.run_distributed, or destroy the group")


_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "CROSS_RANK", "CROSS_SIZE")


@pytest.fixture(autouse=True)
def _launch_environment_restored():
    """``deepspeed.init_distributed`` writes the launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) into the
    environment, as DeepSpeed does; left in the pytest process they would make a later test (zero.Init, the comm
    discovery) believe it runs under a launcher. Each test starts and ends with the same values."""
    import os

    before = {name: os.environ.get(name) for name in _LAUNCH_VARS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

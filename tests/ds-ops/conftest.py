"""ds-ops test harness: one JIT cache per test session, so each op is compiled at most once.

The session cache is filled by two processes building the ops concurrently (exercising the build lock);
their timings are kept for test_op_builder.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# Lets test modules import _ds_ops_optim_helpers and _ds_ops_aio_fixtures (pytest runs with --import-mode=importlib).
sys.path.insert(0, str(Path(__file__).resolve().parent))

_BUILD_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from ds_ops.op_builder import CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder
    out = {}
    for cls in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder):
        t0 = time.perf_counter()
        cls().load()
        out[cls.NAME] = time.perf_counter() - t0
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="session")
def ops_cache(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Session JIT cache (DS_OPS_CACHE_DIR) built by two concurrent processes; returns their timings."""
    cache = tmp_path_factory.mktemp("ds_ops_cache")
    os.environ["DS_OPS_CACHE_DIR"] = str(cache)
    env = {**os.environ, "DS_OPS_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"dir": Path(cache), "timings": results}


@pytest.fixture()
def native(ops_cache: dict) -> dict:
    """Depend on this to run with the session's compiled ops."""
    return ops_cache


def pytest_collection_modifyitems(items: list) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

"""Every error class of the project survives a pickle round trip.

``multiprocessing`` (pools, DeepSpeed's own test harness, data-loader workers) re-raises a worker's error in the
parent by unpickling it. An exception whose ``__init__`` takes other arguments than ``BaseException.args`` cannot
be rebuilt, which kills the pool's result thread: the parent then waits forever instead of reporting the error.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_EXCEPTION_BASES = ("Error", "Exception", "Abort", "Interrupt")


def _error_classes_with_init() -> list[str]:
    found = []
    for path in sorted((ROOT / "packages").glob("*/src/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b) for b in node.bases]
            methods = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
            if any(b.endswith(_EXCEPTION_BASES) for b in bases) and "__init__" in methods \
                    and "__reduce__" not in methods:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return found


def test_every_error_with_its_own_init_defines_reduce():
    # ElasticityError rebuilds through ConfigError.__reduce__ (its problems are its first argument)
    allowed = {"ElasticityError"}
    missing = [entry for entry in _error_classes_with_init() if entry.rsplit(" ", 1)[1] not in allowed]
    assert not missing, "errors with an __init__ of their own need a __reduce__ that rebuilds them: " + str(missing)


def _instances() -> list[BaseException]:
    from deepspeed.runtime.checkpointing.errors import CheckpointRankError, CorruptCheckpointError
    from ds_config import ConfigError
    from ds_config.elasticity import ElasticityConfigError
    from ds_ops.aio._errors import AioError
    from ds_pipe.p2p import PipelineAbort

    return [ConfigError("bad value", "zero_optimization.stage", 7), ElasticityConfigError("no batch sizes"),
            AioError("async_pread", "/tmp/x", 5, "input/output error"),
            AioError("sync_pwrite", "/tmp/y", None, "short"),
            PipelineAbort("stage 1 failed", 1),
            CorruptCheckpointError("x.pt: truncated", "x.pt", "truncated"),
            CheckpointRankError("load_checkpoint failed on ranks [1]", "load_checkpoint", "reading", 0, {1: "x.pt"})]


@pytest.mark.parametrize("index", range(7))
def test_errors_round_trip_through_pickle(index):
    error = _instances()[index]
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert {k: v for k, v in vars(back).items()} == {k: v for k, v in vars(error).items()}

"""Run a few tasks in forked processes (the analyzer's "threads") and collect their results.

DeepSpeed runs map and reduce threads as ``multiprocessing.Process`` es: metric functions are Python code that
the GIL would serialise. Fork (not spawn) so that tasks may be closures over the dataset and the metric
functions, which need not be picklable. Results come back through files, not a pipe, so a large result
cannot deadlock a child against the parent's ``join``; a child that fails or dies is an error naming it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _child(task: Callable[[], Any], path: str) -> None:
    # an OpenMP pool the parent already used does not survive fork (a parallel torch op would hang): one
    # intra-op thread per child, which is what parallel processes want anyway
    torch.set_num_threads(1)
    try:
        outcome = (True, task())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with the traceback
        outcome = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(path, "wb") as handle:
        pickle.dump(outcome, handle)


def run_tasks(tasks: Sequence[Callable[[], Any]], names: Sequence[str]) -> list[Any]:
    """``[task() for task in tasks]``, one forked process per task when there are several (inline for one).

    ``names`` label the tasks in errors ("map thread 2"). Raises ``RuntimeError`` when a task raised or its
    process died, after every process has finished.
    """
    if len(tasks) <= 1:
        return [task() for task in tasks]
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="ds_data_analyzer_") as tmp:
        paths = [os.path.join(tmp, f"{i}.pkl") for i in range(len(tasks))]
        procs = [context.Process(target=_child, args=(task, path), daemon=True) for task, path in zip(tasks, paths,
                                                                                                       strict=True)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        results, failures = [], []
        for name, proc, path in zip(names, procs, paths, strict=True):
            if not os.path.isfile(path):
                failures.append(f"{name}: process died with exit code {proc.exitcode}")
                continue
            with open(path, "rb") as handle:
                ok, value = pickle.load(handle)  # noqa: S301 - written by our own child just now
            if not ok:
                failures.append(f"{name}: {value}")
            results.append(value)
    if failures:
        raise RuntimeError("data analysis failed in " + "; ".join(failures))
    return results

"""Collectives run while a graph is being compiled (profiling runs, the all-gather cost model, the passes' votes)
must not run under PyTorch's Python dispatcher.

AOT autograd compiles with the Python dispatcher on. Under it a ``c10d`` operator is dispatched through Python and
reaches ``ProcessGroupGloo::enqueue`` still holding the GIL (the binding released it, the Python dispatcher took it
back). Gloo's worker thread destroys the previous finished work while holding the queue's lock, and dropping that
work's tensors may decrement a Python object, which needs the GIL: the main thread waits for the lock, the worker
for the GIL, and the ranks stall in a collective every one of them entered (seen on 2 gloo ranks as a profiling
vote that never returned, about one run in two). Outside the Python dispatcher the binding keeps the GIL released
while it enqueues, so the worker can finish.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def outside_python_dispatcher() -> Iterator[None]:
    """Run the body with the Python dispatcher off (a no-op when it is off already or this torch lacks it)."""
    disable = getattr(torch._C, "_DisablePythonDispatcher", None)
    if disable is None:
        yield
        return
    with disable():
        yield

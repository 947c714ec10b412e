"""Helpers shared by the checkpoint tests (layer-level and engine-level)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import torch


def assert_same_tensors(a, b) -> None:
    """Bitwise equality of nested containers of tensors."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_tensors(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tensors(x, y)
    else:
        assert a == b


def sigkill_when_blocked(child: subprocess.Popen, marker: Path, timeout: float) -> None:
    """Wait until ``child`` creates ``marker`` (it reached the injected kill point), then SIGKILL it."""
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists():
            assert child.poll() is None, child.stdout.read().decode()
            assert time.monotonic() < deadline, "the child never reached the injected kill point"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

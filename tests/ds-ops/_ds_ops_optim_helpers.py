"""Shared helpers: run two optimizers on identical params and grads, compare with a relative bound."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import torch

SIZES = (1, 15, 17, 1000, 3001)  # tails shorter than a vector, one vector plus one, odd lengths
BIG = (70_001, 1, 40_003)  # more than 2 x 32768 elements in all: the kernel splits them across threads


def make_params(sizes=SIZES, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in sizes]


def train_pair(make_a: Callable, make_b: Callable, params: list[torch.Tensor], steps: int = 100,
               groups: Callable | None = None, seed: int = 1) -> tuple[list, list, object, object]:
    """Step two optimizers ``steps`` times on clones of ``params`` with the same random grads."""
    a = [torch.nn.Parameter(p.clone()) for p in params]
    b = [torch.nn.Parameter(p.clone()) for p in params]
    opt_a = make_a(groups(a) if groups else a)
    opt_b = make_b(groups(b) if groups else b)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for x, y in zip(a, b, strict=True):
            grad = torch.randn(x.shape, generator=gen).to(x.dtype)
            x.grad = grad.clone()
            y.grad = grad.clone()
        opt_a.step()
        opt_b.step()
    return a, b, opt_a, opt_b


def assert_rel_close(actual: list[torch.Tensor], expected: list[torch.Tensor], rel: float = 1e-5) -> None:
    """Each tensor within ``rel`` of the reference: max abs error <= rel * max|expected|, and in norm."""
    for i, (x, y) in enumerate(zip(actual, expected, strict=True)):
        x, y = x.detach().double(), y.detach().double()
        scale = y.abs().max().item()
        err = (x - y).abs().max().item()
        assert err <= rel * scale, f"tensor {i}: max error {err:.3g} > {rel} * {scale:.3g}"
        assert (x - y).norm() <= rel * y.norm(), f"tensor {i}: relative norm error above {rel}"


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with this environment plus ``env``."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=timeout, check=False)

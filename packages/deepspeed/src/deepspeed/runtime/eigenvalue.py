"""Hessian eigenvalues per model block (DeepSpeed's ``eigenvalue`` section; ``deepspeed.runtime.eigenvalue``).

For each of the ``layer_num`` blocks of the module list at ``layer_name`` (``bert.encoder.layer``), power
iteration on Hessian-vector products estimates the dominant eigenvalue of the loss Hessian restricted to that
block's parameters. The Hessian-vector product differentiates the gradients a second time, so the backward
that produced them must have built a graph (``create_graph=True``: the engine asks for it when the section is
enabled). Values are normalised to [0, 1] by the largest magnitude (a block without a finite estimate gets 1.0),
as DeepSpeed's MoQ schedule consumes them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from deepspeed.utils import log_dist

__all__ = ["Eigenvalue", "eigenvalue_summary_events"]


def eigenvalue_summary_events(block_eigenvalue: dict[Any, tuple[float, int]],
                              global_samples: int) -> list[tuple[str, float, int]]:
    """Monitor events for ``compute_eigenvalue``'s result (``{param id: (value, block)}``): one
    ``Train/Eigenvalues/ModelBlockParam_{i}`` event per entry, in order, at ``global_samples``."""
    return [(f"Train/Eigenvalues/ModelBlockParam_{i}", value[0], global_samples)
            for i, value in enumerate(block_eigenvalue.values())]


class Eigenvalue:
    """Power iteration over the blocks of ``layer_name``; arguments as the ``eigenvalue`` config section."""

    def __init__(self, verbose: bool = False, max_iter: int = 100, tol: float = 1e-2, stability: float = 0,
                 gas_boundary_resolution: int = 1, layer_name: str = "", layer_num: int = 0) -> None:
        if not layer_name or layer_num <= 0:
            raise ValueError(f"eigenvalue: layer_name ({layer_name!r}) must name a module list and layer_num "
                             f"({layer_num}) must be positive")
        self.verbose, self.max_iter, self.tol, self.stability = verbose, max_iter, tol, stability
        self.gas_boundary_resolution, self.layer_name, self.layer_num = gas_boundary_resolution, layer_name, layer_num
        log_dist(f"enabled eigenvalue with verbose={verbose}, max_iter={max_iter}, tol={tol}, stability={stability}, "
                 f"gas_boundary_resolution={gas_boundary_resolution}, layer_name={layer_name}, "
                 f"layer_num={layer_num}", ranks=[0])

    @staticmethod
    def nan_to_num(x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    @staticmethod
    def inner_product(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum(torch.sum(x * y) for x, y in zip(xs, ys, strict=True))

    def normalize(self, v: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        norm = self.inner_product(v, v) ** 0.5 + self.stability
        return [self.nan_to_num(x / norm) for x in v]

    def get_layers(self, module: nn.Module) -> nn.Module:
        layers = module
        for name in self.layer_name.split("."):
            if not hasattr(layers, name):
                raise ValueError(f"eigenvalue.layer_name {self.layer_name!r}: {type(layers).__name__} has no "
                                 f"attribute {name!r}")
            layers = getattr(layers, name)
        return layers

    def compute_eigenvalue(self, module: nn.Module, device: Any = None, scale: float = 1.0) -> dict[int, tuple]:
        """``{id(param): (normalised eigenvalue, block index)}`` for every parameter of the analysed blocks; empty
        (with a warning) when the gradients carry no graph (the backward did not use ``create_graph``)."""
        layers = self.get_layers(module)
        values, keys = [], []
        for block in range(self.layer_num):
            params = [p for p in layers[block].parameters() if p.grad is not None and p.grad.grad_fn is not None]
            if not params:
                log_dist("The model does NOT support eigenvalue computation.", ranks=[0], level=logging.WARNING)
                return {}
            keys.append([id(p) for p in layers[block].parameters()])
            values.append(self._power_iteration(params, device, scale, block))
        values = self.post_process(values)
        if self.verbose:
            log_dist(f"post processed block_eigenvalue: {values}", ranks=[0])
        result = {}
        for block, (block_keys, value) in enumerate(zip(keys, values, strict=True)):
            result.update(dict.fromkeys(block_keys, (value, block)))
        return result

    def _power_iteration(self, params: list[torch.Tensor], device: Any, scale: float, block: int) -> float:
        # The random start vector must not move the training run's random stream.
        state = torch.random.get_rng_state()
        v = self.normalize([torch.randn(p.shape, device=device if device is not None else p.device)
                            for p in params])
        torch.random.set_rng_state(state)
        grads = [p.grad for p in params]
        current, previous, i = 1.0, 0.0, 0
        while i < self.max_iter and current != 0 and abs((current - previous) / current) >= self.tol:
            previous = current
            hv = torch.autograd.grad(grads, params, grad_outputs=v, only_inputs=True, retain_graph=True)
            hv = [self.nan_to_num(h).float() for h in hv]
            current = self.inner_product(hv, v).item()
            v = [x / scale for x in self.normalize(hv)]
            i += 1
        current *= scale
        if self.verbose:
            log_dist(f"block: {block}, power iteration: {i}, eigenvalue: {current}", ranks=[0])
        return current

    @staticmethod
    def post_process(values: list[float]) -> list[float]:
        """Magnitudes over the largest magnitude; 1.0 for a block whose estimate is 0 (fp16 can give none)."""
        largest = max(abs(v) for v in values)
        if largest == 0:
            return [1.0] * len(values)
        return [abs(v) / largest if v != 0.0 else 1.0 for v in values]

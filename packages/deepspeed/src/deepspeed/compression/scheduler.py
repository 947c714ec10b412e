"""``compression_scheduler``: switches each compression technique on at its ``schedule_offset`` and drives the
weight-quantization bit schedule. The engine steps it after every applied optimizer step; a hand-written loop
calls ``step()`` after ``optimizer.step()``.

Bit schedule (the config reference: "for every n steps, the quantization bits will be reduced by 1"): at ``s``
steps past ``schedule_offset`` a group quantizes to ``max(target_bits, start_bits - s // quantization_period)``.
With ``fp16_mixed_quantize`` the weight is ``r * w + (1 - r) * q(w)`` where the quantized share ``1 - r`` starts at
``quantize_change_ratio`` and grows by it every step (back to the start whenever the bits drop) until it is 1.
In optimizer-step mode (``quantize_weight_in_forward: false``) the stored weights are replaced by their quantized
values after each step; the fp16/bf16 optimizer's fp32 master weights stay exact.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from deepspeed.compression.compress import get_compress_methods
from deepspeed.compression.config import TECHNIQUES, get_compression_config
from deepspeed.compression.helper import recursive_getattr
from deepspeed.utils.logging import logger

_KIND = {"weight_quantization": "weight_quantization", "activation_quantization": "activation_quantization",
         "sparse_pruning": "sparse", "row_pruning": "row", "head_pruning": "head", "channel_pruning": "channel"}
"""Technique -> the kind name the layers use (``<kind>_pruning_enabled``)."""


def scheduled_bits(steps_since_offset: int, start_bits: int, target_bits: int, quantization_period: int) -> int:
    """Quantization bits ``steps_since_offset`` steps after the schedule offset (one bit less per period)."""
    return max(target_bits, start_bits - steps_since_offset // quantization_period)


def quantized_share(steps_since_offset: int, start_bits: int, target_bits: int, quantization_period: int,
                    change_ratio: float) -> float:
    """``fp16_mixed_quantize``: the share of the quantized value in the weight (1 = fully quantized)."""
    drops = min(steps_since_offset // quantization_period, start_bits - target_bits)
    since_change = steps_since_offset - drops * quantization_period
    return min(1.0, change_ratio * (since_change + 1))


class compression_scheduler:  # noqa: N801 -- DeepSpeed's class name
    """Schedules the techniques of ``compression_config`` (a config dict/path, ``DeepSpeedConfig`` or
    ``CompressionConfig``) on ``model``, which ``init_compression`` has prepared. Construction applies step 0
    (techniques with ``schedule_offset: 0`` are on from the first forward)."""

    def __init__(self, model: nn.Module, compression_config: Any) -> None:
        self.model = getattr(model, "module", model)
        self.compression_config = get_compression_config(compression_config)
        self.training_steps = 0
        self.weight_quantization_enabled = False
        self.verbose = dict.fromkeys(TECHNIQUES, False)
        self.make_init()
        self.check_all_modules(quantize_weights=False)

    def make_init(self) -> None:
        """Resolve every group's module patterns to the model's compression layers."""
        self.different_compression_methods: dict[str, list[tuple[list[nn.Module], dict]]] = {}
        for module_lists, _related, technique in get_compress_methods(self.model, self.compression_config):
            (name, params), = technique.items()
            modules = [self._prepared(n) for names in module_lists for n in names]
            self.different_compression_methods.setdefault(name, []).append((modules, params))

    def _prepared(self, name: str) -> nn.Module:
        module = recursive_getattr(self.model, name)
        if not hasattr(module, "activate"):
            raise RuntimeError(f"compression_scheduler: module {name!r} ({type(module).__name__}) is not prepared "
                               "for compression; call deepspeed.compression.init_compression(model, ds_config) first")
        return module

    def _offset(self, technique: str) -> int | None:
        """Steps past the technique's offset, or None while it is off."""
        shared = getattr(self.compression_config, technique).shared_parameters
        if not shared.enabled or self.training_steps < shared.schedule_offset:
            return None
        return self.training_steps - shared.schedule_offset

    def _announce(self, technique: str, detail: str = "") -> None:
        if not self.verbose[technique]:
            logger.info(f"{technique.replace('_', ' ').capitalize()} is enabled at step {self.training_steps}{detail}")
            self.verbose[technique] = True

    def check_weight_quantization(self, quantize_weights: bool = True) -> None:
        s = self._offset("weight_quantization")
        if s is None:
            return
        self.weight_quantization_enabled = True
        for modules, p in self.different_compression_methods.get("weight_quantization", []):
            args = (s, p["start_bits"], p["target_bits"], p["quantization_period"])
            bits = scheduled_bits(*args)
            mixed = p["fp16_mixed_quantize"]
            real = 1.0 - quantized_share(*args, mixed["quantize_change_ratio"]) if mixed["enabled"] else 0.0
            for module in modules:
                if p["quantize_verbose"] and module.weight_quantize_bits != bits:
                    logger.info(f"weight quantization: {bits} bits from step {self.training_steps}")
                module.activate("weight_quantization")
                module.set_weight_quantization_state(bits, real)
                if quantize_weights and not p["quantize_weight_in_forward"]:
                    module.quantize_weight_in_place()
        self._announce("weight_quantization")

    def _check(self, technique: str) -> None:
        if self._offset(technique) is None:
            return
        for modules, _ in self.different_compression_methods.get(technique, []):
            for module in modules:
                module.activate(_KIND[technique])
        self._announce(technique)

    def check_activation_quantization(self) -> None:
        self._check("activation_quantization")

    def check_sparse_pruning(self) -> None:
        self._check("sparse_pruning")

    def check_head_pruning(self) -> None:
        self._check("head_pruning")

    def check_row_pruning(self) -> None:
        self._check("row_pruning")

    def check_channel_pruning(self) -> None:
        self._check("channel_pruning")

    def check_all_modules(self, quantize_weights: bool = True) -> None:
        """Apply the schedule at the current step (``quantize_weights``: run optimizer-step quantization)."""
        self.check_weight_quantization(quantize_weights)
        self.check_activation_quantization()
        self.check_sparse_pruning()
        self.check_head_pruning()
        self.check_row_pruning()
        self.check_channel_pruning()

    def step(self, step_zero_check: bool = False) -> None:
        """Advance one training step (``step_zero_check``: re-apply the current step without advancing)."""
        if not step_zero_check:
            self.training_steps += 1
        self.check_all_modules(quantize_weights=not step_zero_check)

    def state_dict(self) -> dict[str, int]:
        return {"training_steps": self.training_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.training_steps = int(state["training_steps"])
        self.check_all_modules(quantize_weights=False)

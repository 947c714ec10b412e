"""``compression_training`` in the engine: the compression scheduler it steps after every applied optimizer step
(as DeepSpeed's engine does), built on the module before the optimizer sees its parameters (top-k pruning scores
are trainable parameters).

The schedule counts the engine's ``global_steps``, so a run resumed from a checkpoint goes on where it stopped:
a forward pre-hook re-applies the schedule whenever the engine's step count moved without the scheduler (a
restored checkpoint, a skipped fp16 step).

DeepSpeed's flow calls ``init_compression(model, ds_config)`` before ``deepspeed.initialize``; when a script did not,
the engine does it here, so a config section alone is enough (layer reduction still needs the script's call, with
its teacher model).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from deepspeed.compression import compression_scheduler, init_compression
from deepspeed.compression.config import any_technique_enabled
from ds_config import ConfigError, ConfigProblem


class EngineCompressionScheduler(compression_scheduler):
    """A ``compression_scheduler`` whose step count is the engine's ``global_steps``."""

    def __init__(self, engine: Any, compression_config: Any) -> None:
        self._engine = weakref.ref(engine)
        super().__init__(engine.module, compression_config)
        self._hook = engine.module.register_forward_pre_hook(self._sync)

    def _engine_steps(self) -> int:
        engine = self._engine()
        return self.training_steps if engine is None else engine.global_steps

    def step(self, step_zero_check: bool = False) -> None:
        # called inside the engine's step, before it counts the step: this step is global_steps + 1
        if not step_zero_check:
            self.training_steps = self._engine_steps()
        super().step(step_zero_check)

    def _sync(self, module: torch.nn.Module, args: Any) -> None:
        steps = self._engine_steps()
        if steps != self.training_steps:
            self.training_steps = steps
            self.check_all_modules(quantize_weights=False)


def _prepared(module: torch.nn.Module) -> bool:
    return any(hasattr(m, "init_compression_state") for m in module.modules())


def _check(config: Any) -> None:
    if config.zero_stage == 3:
        raise ConfigError(ConfigProblem("zero_optimization.stage", "compression_training runs with ZeRO stages 0-2 "
                                        "in this version (its masks and scores live on whole layers); accepted: "
                                        "0, 1, 2", 3))
    wq = config.compression_training.weight_quantization.shared_parameters
    if wq.enabled and not wq.quantize_weight_in_forward and config.precision == "fp32":
        raise ConfigError(ConfigProblem(
            "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward",
            "must be true for FP32 training: quantizing in the optimizer step overwrites the fp16/bf16 model "
            "weights and needs the fp32 master copy that fp16/bf16 training keeps; set it to true or enable "
            "fp16/bf16", False))


def build_compression_scheduler(engine: Any, config: Any) -> EngineCompressionScheduler | None:
    """The ``compression_scheduler`` of ``engine.module``, or None when no technique is enabled."""
    section = config.compression_training
    if not any_technique_enabled(section):
        return None
    _check(config)
    if not _prepared(engine.module):
        init_compression(engine.module, section)
    return EngineCompressionScheduler(engine, section)

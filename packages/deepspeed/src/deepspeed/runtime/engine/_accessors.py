"""The engine's config accessors, in one place: the methods Hugging Face Transformers, Accelerate and
DeepSpeed's own clients call (``engine.zero_optimization_stage()``, ``engine.gradient_accumulation_steps()``,
...). Each reads the typed config (``self._config``, a ``ds_config.DeepSpeedConfig``) and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed.runtime.engine._zero3 import _setting

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class ConfigAccessors:
    """Mixin for ``DeepSpeedEngine``; requires ``self._config``."""

    _config: Any
    config: dict[str, Any]
    dp_world_size: int

    _require_step_boundary: Callable[[str], None]  # the engine's: batch geometry changes between steps only

    def sparse_gradients_enabled(self) -> bool:
        return bool(self._config.sparse_gradients)

    # ---- batch ----
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def managed_gradient_accumulation(self) -> bool:
        """False when the caller's ``step()`` is the accumulation boundary (``managed_gradient_accumulation``)."""
        return bool(self._config.managed_gradient_accumulation)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the gradient accumulation steps; the micro batch stays
        (DeepSpeed's batch-size ramp-up, e.g. Megatron's ``--rampup-batch-size``). Call it between optimizer
        steps: the next accumulation window is the new number of micro-steps long."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size <= 0 \
                or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size: train_batch_size={train_batch_size!r} is invalid; accepted: a "
                             f"positive multiple of train_micro_batch_size_per_gpu x data-parallel size = {per_step}")
        self._require_step_boundary("set_train_batch_size")
        self._set_batch(train_batch_size, self.train_micro_batch_size_per_gpu(), train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch; the gradient accumulation steps stay, so the global batch follows."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size: micro_batch_size={micro_batch_size!r} is invalid; "
                             "accepted: a positive int")
        gas = self.gradient_accumulation_steps()
        self._set_batch(micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas)

    def _set_batch(self, train_batch_size: int, micro_batch_size: int, gas: int) -> None:
        self._config.train_batch_size = train_batch_size
        self._config.train_micro_batch_size_per_gpu = micro_batch_size
        self._config.gradient_accumulation_steps = gas
        self.config.update(train_batch_size=train_batch_size, train_micro_batch_size_per_gpu=micro_batch_size,
                           gradient_accumulation_steps=gas)

    # ---- ZeRO ----
    def zero_optimization(self) -> bool:
        return self._config.zero_enabled

    # these four also read DeepSpeed's config attribute names (a DeepSpeed-style config object, as DeepSpeed's
    # white-box tests give the engine), else the typed config's
    def zero_optimization_stage(self) -> int:
        return _setting(self._config, "zero_optimization_stage", "zero_stage")

    def autotp_size(self) -> int:
        """``tensor_parallel.autotp_size``: the AutoTP training degree the config asks for (0 or 1: none)."""
        return _setting(self._config, "tensor_parallel_config.autotp_size", "tensor_parallel.autotp_size")

    def zero_optimization_partition_gradients(self) -> bool:
        return self._config.zero_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._config.zero_stage >= 3

    def zero_offload_optimizer(self) -> Any:
        return _setting(self._config, "zero_config.offload_optimizer", "zero_optimization.offload_optimizer")

    def zero_use_cpu_optimizer(self) -> bool:
        """The optimizer steps off the accelerator: ``offload_optimizer.device`` is cpu or nvme (none: inert)."""
        off = self._config.zero_optimization.offload_optimizer
        return off is not None and str(getattr(off.device, "value", off.device)) in ("cpu", "nvme")

    def zero_offload_param(self) -> Any:
        return _setting(self._config, "zero_config.offload_param", "zero_optimization.offload_param")

    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(getattr(self._config.zero_optimization, "gather_16bit_weights_on_model_save", False))

    def zero_hpz_partition_size(self) -> int:  # ZeRO++
        return self._config.zero_optimization.zero_hpz_partition_size

    def zero_quantized_weights(self) -> bool:
        return self._config.zero_optimization.zero_quantized_weights

    def zero_quantized_nontrainable_weights(self) -> bool:
        return self._config.zero_optimization.zero_quantized_nontrainable_weights

    def zero_quantized_gradients(self) -> bool:
        return self._config.zero_optimization.zero_quantized_gradients

    def zero_save_muon_momentum_buffer_in_memory(self) -> bool:  # Muon with ZeRO-3 NVMe offload
        return self._config.zero_optimization.save_muon_momentum_buffer_in_memory

    # ---- precision ----
    def fp16_enabled(self) -> bool:
        return self._config.fp16_enabled

    def bf16_enabled(self) -> bool:
        return self._config.bf16_enabled

    def bfloat16_enabled(self) -> bool:  # DeepSpeed's own name for it (Megatron-DeepSpeed calls this one)
        return self._config.bf16_enabled

    def amp_enabled(self) -> bool:
        return self._config.amp_enabled

    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast_enabled

    def fp16_auto_cast(self) -> bool:
        return self._config.fp16.auto_cast

    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16_enabled and self._config.fp16.dynamic_loss_scale

    def initial_dynamic_scale(self) -> float:
        return self._config.initial_dynamic_scale

    def dynamic_loss_scale_args(self) -> dict[str, Any] | None:
        return self._config.dynamic_loss_scale_args

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype)."""
        model = _DTYPES[self._config.precision]
        accum = self._config.data_types.grad_accum_dtype
        return model, _DTYPES[accum] if accum else model

    # ---- communication and clipping ----
    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def prescale_gradients(self) -> bool:
        return self._config.prescale_gradients

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    def gradient_allreduce_op(self) -> str:
        return self._config.gradient_allreduce_op

    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    def allreduce_always_fp32(self) -> bool:
        return self._config.fp32_allreduce

    @property
    def communication_data_type(self) -> torch.dtype:
        name = self._config.communication_data_type
        if name is not None:
            return _DTYPES[name]
        return torch.float32 if self._config.fp32_allreduce else _DTYPES[self._config.precision]

    # ---- optimizer / schedule names ----
    def optimizer_name(self) -> str | None:
        return self._config.optimizer_name

    def optimizer_params(self) -> dict[str, Any] | None:
        return self._config.optimizer_params

    def scheduler_name(self) -> str | None:
        return self._config.scheduler_name

    def scheduler_params(self) -> dict[str, Any] | None:
        return self._config.scheduler_params

    # ---- logging ----
    def steps_per_print(self) -> int | float:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def memory_breakdown(self) -> bool:
        return self._config.memory_breakdown

    def dump_state(self) -> bool:
        return self._config.dump_state

    def log_level(self) -> str | None:
        """The config's ``log_level`` as written (``"ERROR"``), or None: DeepSpeed's logger keeps its level."""
        return self._config.log_level

    def flops_profiler_enabled(self) -> bool:
        return self._config.flops_profiler.enabled

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint.tag_validation == "Fail"

    def get_pld_theta(self) -> float | None:
        """Progressive Layer Dropping's current keep probability (None when PLD is off)."""
        pld = getattr(self, "progressive_layer_drop", None)
        return None if pld is None else pld.get_theta()

"""``DeepSpeedEngine``: the training loop's object (forward, backward, step), composed of what the modules of this
folder build and wire in, one concern each.

The engine is thin: the optimizer wrapper (``optimizer_wrapper.OptimizerWrapper``) owns precision, loss
scaling, clipping and the update; the gradient reducer averages gradients over the data-parallel group,
overlapped with backward through per-parameter gradient hooks. The hooks also serve a direct ``loss.backward()``
(what ``engine.backward`` does, minus the division by the gradient accumulation steps).

The modules of this folder: ``_setup`` (the constructor's steps, in order), ``_module`` (device, broadcast),
``_stages`` (the ZeRO stage registry; stage 0), ``_zero`` / ``_zero3`` / ``_zero_states`` (ZeRO 1-2, ZeRO-3 and
its engine methods, ``offload_states``), ``_precision``, ``_optimizer`` (optimizer and LR schedule), ``_moe`` /
``_moe_checkpoint``, ``_autoep_configure`` (AutoEP), ``_compression``, ``_data_efficiency`` (data loader,
curriculum, dynamic batching), ``_pld``, ``_reporting`` (log line, monitors, flops profiler), ``_accessors``,
``_timers``; checkpoints are ``deepspeed.runtime.checkpointing``, AutoTP training ``deepspeed.runtime.autotp``,
AutoEP's step ``deepspeed.runtime.autoep``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed import comm as dist  # noqa: F401 - DeepSpeed's engine module has it (deepspeed.comm)
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.utils import checkpoint_parallel_metadata as _checkpoint_parallel_metadata  # noqa: F401
from deepspeed.runtime.eigenvalue import eigenvalue_summary_events as _eigenvalue_summary_events  # noqa: F401
from deepspeed.runtime.engine import _eigenvalue, _module, _moe, _optimizer, _setup, _stages, _unmanaged, _zero
from deepspeed.runtime.engine._accessors import ConfigAccessors
from deepspeed.runtime.engine._autoep_configure import AutoEPConfigureMethods
from deepspeed.runtime.engine._autoep_folding import AutoEPFoldingMethods
from deepspeed.runtime.engine._ckpt_names import CheckpointNameMethods
from deepspeed.runtime.engine._compression import build_compression_scheduler
from deepspeed.runtime.engine._data_efficiency import DataMethods
from deepspeed.runtime.engine._deepcompile import DeepCompileMethods
from deepspeed.runtime.engine._grad_sync import GradSyncContextError, GradSyncMethods
from deepspeed.runtime.engine._module_state import ModuleStateMethods
from deepspeed.runtime.engine._precision import MixedPrecisionMethods, is_zero_init_model
from deepspeed.runtime.engine._timers import (
    BACKWARD,
    BACKWARD_INNER,
    BACKWARD_REDUCE,
    FORWARD,
    STEP,
    PhaseTimers,
    Throughput,
)
from deepspeed.runtime.engine._weak_hook import weak_hook
from deepspeed.runtime.engine._zero3 import Zero3EngineMethods
from deepspeed.runtime.engine._zero_states import ZeroStateMethods
from deepspeed.runtime.optimizer_wrapper import trainable
from deepspeed.runtime.peer_failure import announce, named_peer_failures
from deepspeed.runtime.torch_autocast import autocast_context, init_autocast_params
from deepspeed.utils import groups as groups  # DeepSpeed's engine module has it (AutoEP's expert groups)
from deepspeed.utils import log_dist
from deepspeed.utils.timer import ThroughputTimer
from deepspeed.utils.torch import is_functorch_transforming

_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


class LossArgumentError(TypeError, AssertionError):
    """``engine.scale(loss)`` given something other than a scalar loss with a graph: DeepSpeed asserts there."""


class DeepSpeedEngine(ConfigAccessors, MixedPrecisionMethods, Zero3EngineMethods, ZeroStateMethods, DataMethods,
                      CheckpointNameMethods, DeepCompileMethods, AutoEPConfigureMethods, AutoEPFoldingMethods,
                      GradSyncMethods, ModuleStateMethods, torch.nn.Module):
    """Wraps ``model`` for training with the typed ``config`` (a ``DeepSpeedConfig`` whose batch sizes are
    resolved). ``optimizer`` is a torch optimizer or a callable taking the parameters (else the config's);
    ``lr_scheduler`` a schedule or a callable taking the optimizer (else the config's); ``training_data``
    a dataset for ``training_dataloader``; ``mpu`` a model-parallel unit or ``dp_group`` the data-parallel
    group (default: the whole world). Built by ``deepspeed.initialize``."""

    pipeline_parallelism = False  # DeepSpeed's attribute: whether this engine runs a PipelineModule

    def __init__(self, model: torch.nn.Module, config: Any, optimizer: Any = None, model_parameters: Any = None,
                 lr_scheduler: Any = None, training_data: Any = None, collate_fn: Any = None,
                 mpu: Any = None, dp_group: Any = None) -> None:
        super().__init__()
        config.require_resolved()
        self._config = config
        self.config = config.to_dict()
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._window_start = 0  # micro_steps where the current accumulation windows began (set_train_batch_size)
        _setup.place(self, mpu, dp_group)
        self._assert_valid_mixed_precision_config()
        self.module = _module.check_module(model)
        optimizer, model_parameters = self._configure_autoep(model, optimizer, model_parameters)  # DeepSpeed's order
        param_dtype, buffer_dtype = self._mixed_precision_dtypes()  # fp16/bf16 weights; buffers keep their dtype
        self._cast_module_mixed_precision(param_dtype, buffer_dtype, is_zero_init_model(self.module, config.zero_stage))
        self.module.to(self.device)  # after the cast: low-precision weights travel at half size
        self.sparse_tensor_module_names = _module.sparse_tensor_names(self.module, config.sparse_gradients)
        self.compression_scheduler = build_compression_scheduler(self, config)  # compression_training
        _setup.distribute_module(self, config, mpu)  # MoE groups; ZeRO-3 partitions or a broadcast
        if config.torch_autocast_enabled:
            init_autocast_params(self, self._autocast_dtype(), config.torch_autocast.lower_precision_safe_modules)
        self._released: str | None = None  # why this engine may no longer train (see _release)
        self._configure_optimizer(optimizer, model_parameters, lr_scheduler)
        _setup.add_checkpoint_shards(self)  # MoE experts, AutoTP-sharded layers
        self._configure_training_state()
        _setup.attach_features(self, config, training_data, collate_fn)
        _setup.log_startup(self, config)
        announce()  # host and pid, so that a peer's failure can be named (see _peer_failure)

    def __getattr__(self, name: str) -> Any:
        """Unknown attributes come from the wrapped module (``engine.generate(...)``, ``engine.config_class``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name == "module":
                raise
            return getattr(module, name)

    # ---- construction --------------------------------------------------------------------------------
    def _configure_optimizer(self, optimizer: Any, model_parameters: Any, lr_scheduler: Any) -> None:
        params = trainable(self.module.parameters())
        # without an optimizer the module is simply evaluated (ZeRO-3 still gathers its partitioned weights)
        if optimizer is None and self._config.optimizer is None:
            self._configure_without_optimizer(lr_scheduler)
            return
        _optimizer.mark_muon_params(self.module, optimizer, self._config.optimizer)  # param.use_muon defaults
        chosen = list(model_parameters) if model_parameters is not None else params
        if self.has_moe_layers and not isinstance(optimizer, torch.optim.Optimizer):
            chosen = _moe.param_groups(chosen)  # as DeepSpeed: expert parameters in their own groups
        offload = self._config.zero_optimization.offload_optimizer
        cpu_offload = offload is not None and str(getattr(offload, "device", "none")).endswith(("cpu", "nvme"))
        self.basic_optimizer = _optimizer.build_basic_optimizer(optimizer, self._config.optimizer, chosen, cpu_offload)
        if optimizer is not None and cpu_offload and self._config.zero_stage > 0:
            _zero.check_client_offload_optimizer(self.basic_optimizer, self._config)
        _optimizer.check_zero_optimizer(self.basic_optimizer, self._config.zero_stage,
                                        self._config.zero_allow_untested_optimizer)
        _setup.check_sequence_parallel_optimizer(self)
        trained = {id(p) for group in self.basic_optimizer.param_groups for p in group["params"]}  # before ZeRO
        inputs = _stages.StageInputs(self.module, params, self.basic_optimizer, self._config, self.dp_group,
                                    self.dp_world_size, scheduler=self.zero3_scheduler, mpu=self.mpu,
                                    reduce_group=self.seq_dp_group)
        self.optimizer, self.reducer = _stages.build_stage(inputs)
        self.checkpoint_shards = tuple(getattr(self.optimizer, "checkpoint_shards", ()))
        self.lr_scheduler = _optimizer.build_scheduler(lr_scheduler, self._config, self.optimizer)
        _setup.take_over_module(self, trained)
        on_grad = weak_hook(self._on_grad)
        self._grad_params = params
        self._hook_handles = [p.register_post_accumulate_grad_hook(on_grad) for p in params]

    def _configure_without_optimizer(self, lr_scheduler: Any) -> None:
        """No client optimizer and no ``optimizer`` section: an evaluation/inference engine (as in DeepSpeed,
        e.g. Transformers' and Accelerate's evaluation path): forward works, training calls are an error."""
        if lr_scheduler is not None:
            raise ValueError("deepspeed.initialize: an lr_scheduler was passed but there is no optimizer (neither "
                             "optimizer=... nor an 'optimizer' config section) for it to drive")
        if self._config.scheduler is not None:  # DeepSpeed ignores it too; say so rather than stay silent
            log_dist("the config's 'scheduler' section is ignored: no optimizer (evaluation engine)", ranks=[0])
        self.basic_optimizer = self.optimizer = self.reducer = self.lr_scheduler = None
        self.checkpoint_shards = ()
        self._hook_handles = []

    def _require_optimizer(self, call: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"engine.{call}: this engine was built without an optimizer (evaluation only); pass "
                               "optimizer=... to deepspeed.initialize or add an 'optimizer' config section to train")
        if self._released is not None:
            raise RuntimeError(f"engine.{call}: this engine can no longer train: {self._released}")
        self._require_states_in_place(call)

    def _configure_training_state(self) -> None:
        self._sync_enabled = True
        self._boundary_override: bool | None = None
        self._in_backward = self._syncing = self._scaled = self._engine_backward = False
        self._loss_sum: torch.Tensor | None = None
        self._losses_in_window = 0
        self._steps_in_window = 0
        self._backwards_since_step = 0  # global_samples under managed_gradient_accumulation: false
        self._running_step = False  # that mode's accumulation boundary
        _unmanaged.check(self)
        self.timers = PhaseTimers(self._config.wall_clock_breakdown or self._config.flops_profiler.enabled,
                                  get_accelerator().synchronize)
        self.tput = Throughput()
        # DeepSpeed's samples/s meter (timers.throughput) with its counters; the progress line reports from tput
        spp = self._config.steps_per_print
        self.tput_timer = ThroughputTimer(self._config.timers.throughput, batch_size=self.train_batch_size(),
                                          steps_per_output=int(spp) if math.isfinite(spp) else None)

    def _autocast_dtype(self) -> torch.dtype:
        return _LOW[self._config.torch_autocast.dtype]

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module (under ``torch_autocast`` when configured; fp16 ``auto_cast`` casts float inputs)."""
        self._maybe_start_profile()
        if getattr(self, "training_dataloader", None) is None:  # else the engine's data loader starts it
            self.tput_timer.start()
        self.timers.start(FORWARD)
        if self._config.fp16_enabled and self._config.fp16.auto_cast:
            inputs, kwargs = _cast_floats((inputs, kwargs), torch.float16)
        if self.data_efficiency is not None and self.module.training:
            kwargs = self.data_efficiency.before_forward(self.global_steps, kwargs)
        ctx = autocast_context(self._config.torch_autocast_enabled, self._autocast_dtype(), self.device.type)
        with ctx, named_peer_failures(self.global_steps, "forward"):
            out = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.optimizer is not None:
            # a hook on the outputs runs in the outermost backward, before any reentrant checkpoint's nested one
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._on_output_grad)
        self.timers.stop(FORWARD)
        return out

    def _on_output_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if is_functorch_transforming():  # torch.func differentiates the engine as a plain function: no training step
            return None
        if not self._in_backward:
            self._begin_backward()
        gas = self.gradient_accumulation_steps()
        if self._engine_backward or gas == 1:
            return None
        # a direct loss.backward() (or engine.scale(loss).backward()) averages over the accumulation window as
        # engine.backward's loss / gas does: DeepSpeed divides the gradient reaching each output by gas
        return grad / gas

    # ---- backward --------------------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16 / torch_autocast fp16), for a manual ``.backward()``."""
        self._require_optimizer("scale")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise LossArgumentError(f"engine.scale(loss): loss must be a scalar tensor with grad_fn (the output of a "
                                    f"forward pass); got {type(loss).__name__}"
                                    f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}. For a non-scalar "
                                    "output call output.backward(grad) directly")
        self._scaled = True
        return self.optimizer.scale_loss(loss)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` (divided by the gradient accumulation steps when ``scale_wrt_gas``)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise TypeError(f"engine.backward(loss): loss must be a scalar tensor produced by a forward pass (with "
                            f"requires_grad), got {type(loss).__name__}"
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        self._require_optimizer("backward")
        self._record_loss(loss)
        self._backwards_since_step += 1
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        scaled = self.optimizer.scale_loss(loss)
        with named_peer_failures(self.global_steps, "backward"):
            self._run_backward(lambda: scaled.backward(**_eigenvalue.backward_kwargs(self, retain_graph)))
        return loss

    def _run_backward(self, run: Any) -> None:
        """Run ``run()`` (a backward over gradients that are already loss-scaled) as the engine's backward: the
        gradient hooks do their precision bookkeeping and, on a syncing micro-step, the reduction; timed."""
        self.timers.start(BACKWARD)
        started, reduce_before = time.perf_counter(), self.timers.elapsed_ms[BACKWARD_REDUCE]
        self._scaled = self._engine_backward = True
        try:
            run()
            if not self._in_backward:  # no gradient reached our parameters: still meet the other ranks
                self._syncing = self._should_sync()
            self._end_of_backward()
        finally:
            self._in_backward = self._syncing = self._scaled = self._engine_backward = False
        self.timers.stop(BACKWARD)
        reduced_ms = self.timers.elapsed_ms[BACKWARD_REDUCE] - reduce_before
        self.timers.add(BACKWARD_INNER, (time.perf_counter() - started) * 1e3 - reduced_ms)

    def _backward_epilogue(self) -> None:
        """What scripts written before DeepSpeed 0.18.3 call after ``loss.backward()``: the end of backward now runs
        by itself (a callback queued on autograd's engine), so this only finishes a backward still open."""
        if self._in_backward:
            self._end_of_backward()

    def allreduce_gradients(self, bucket_size: int = 500_000_000) -> None:
        """DeepSpeed's explicit reduction call after backward: gradients are reduced by the backward itself here
        (on each micro-step that syncs), so this only finishes a backward still open; ``bucket_size`` is unused."""
        self._backward_epilogue()

    def _record_loss(self, loss: torch.Tensor) -> None:
        detached = loss.detach().float().reshape(())
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._losses_in_window += 1

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """Per-parameter hook, as the gradient lands: precision bookkeeping, then (maybe) overlapped reduction."""
        if not self._in_backward:
            self._begin_backward()
        if getattr(param, "ds_grad_is_ready", True) is False:  # a tiled compute's partial sum: more will land
            return
        self.optimizer.on_grad(param)
        if self._syncing:
            self.reducer.grad_ready(param)

    def _begin_backward(self) -> None:
        if self.optimizer.scales_loss and not self._scaled:
            raise RuntimeError("loss.backward() was called on an unscaled loss while fp16 loss scaling is on: "
                               "use engine.backward(loss), or engine.scale(loss).backward()")
        self._in_backward = True
        self._syncing = self._should_sync()
        if not self._engine_backward:  # a direct loss.backward(): finish when autograd's graph task ends
            self._backwards_since_step += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        if self._syncing:
            started = time.perf_counter()
            self.reducer.finish()
            self.timers.add(BACKWARD_REDUCE, (time.perf_counter() - started) * 1e3)
        self._in_backward = self._syncing = self._scaled = False

    def _should_sync(self) -> bool:
        """Does this backward reduce gradients? (see ``GradientReducer.every_micro_step``)"""
        if not self._sync_enabled:
            return False
        if self.reducer.every_micro_step:
            return True
        return self.seq_dp_world_size > 1 and self.is_gradient_accumulation_boundary()

    # ---- gradient accumulation and the step -------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if not self._config.managed_gradient_accumulation:
            return self._running_step  # the caller's step() is the boundary (see _unmanaged)
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps - self._window_start + 1) % self.gradient_accumulation_steps() == 0

    def _require_step_boundary(self, call: str) -> None:
        """Batch geometry may change only between optimizer steps; the next window counts from here (DeepSpeed
        counts from step 0, so its first window after a change is cut short: docs/deviations.md)."""
        done = (self.micro_steps - self._window_start) % self.gradient_accumulation_steps()
        if not self._config.managed_gradient_accumulation:
            done = self._backwards_since_step
        if done:
            raise RuntimeError(f"{call}: {done} micro-step(s) of the current accumulation window have gradients "
                               "waiting; call it after engine.step() has taken the optimizer step")
        self._window_start = self.micro_steps

    @property
    def _is_gradient_accumulation_boundary(self) -> bool | None:  # DeepSpeed's attribute for the override
        return self._boundary_override

    @_is_gradient_accumulation_boundary.setter
    def _is_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        self._boundary_override = is_boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary (e.g. Accelerate's last micro batch); ``None`` restores the counter."""
        _unmanaged.refuse(self, "set_gradient_accumulation_boundary()")
        self._boundary_override = is_boundary

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Count a micro-step; at the accumulation boundary update the weights and step the LR schedule."""
        self._require_optimizer("step")
        if getattr(self.reducer, "coalescing", False):
            raise GradSyncContextError("It is illegal to call Engine.step() inside no_sync context manager: "
                                       "engine.step() was called inside coalesce_grad_reduction(); step after the "
                                       "block ends")
        if not self._sync_enabled:  # DeepSpeed's wording: the gradients inside are local, not reduced
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context manager")
        self._running_step = True
        try:
            boundary = self.is_gradient_accumulation_boundary()
            self._step_applied = False
            self.timers.start(STEP)
            if boundary:
                with named_peer_failures(self.global_steps, "step"):
                    if not self._config.managed_gradient_accumulation:
                        _unmanaged.reduce_accumulated(self)
                    _eigenvalue.at_boundary(self)
                    self._take_model_step(lr_kwargs)
        finally:
            self._running_step = False
        self.micro_steps += 1
        self.timers.stop(STEP)
        self.tput_timer.stop(global_step=boundary, report_speed=False)
        if boundary:
            self._after_model_step()

    def _take_model_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        if self.optimizer.step():
            self._step_applied = True
            if self.compression_scheduler is not None:
                self.compression_scheduler.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
            log_dist(f"step {self.global_steps + 1}: gradient overflow, step skipped; loss scale now "
                     f"{self.optimizer.loss_scale:g}", ranks=[0])
        self.zero_grad()
        self._in_backward = self._scaled = False
        self.global_steps += 1
        samples = self.train_batch_size() if self._config.managed_gradient_accumulation \
            else _unmanaged.samples_since_step(self)
        self._backwards_since_step = 0
        self.global_samples += samples
        self.tput.add(samples)

    def _after_model_step(self) -> None:
        from deepspeed.runtime.engine._reporting import report_progress

        self._steps_in_window += 1
        if self.flops_profiler is not None and self.flops_profiler.started:
            cfg = self._config.flops_profiler
            self.flops_profiler.print_model_profile(self.global_steps, cfg.module_depth, cfg.top_modules,
                                                    cfg.detailed, cfg.output_file)
            self.flops_profiler.end_profile()
        spp = self._config.steps_per_print
        if math.isfinite(spp) and self.global_steps % int(spp) == 0:
            report_progress(self)

    def _maybe_start_profile(self) -> None:
        prof = self.flops_profiler
        if prof is not None and not prof.started and self.global_rank == 0 \
                and self.global_steps + 1 == self._config.flops_profiler.profile_step:
            prof.start_profile()

    def was_step_applied(self) -> bool:
        """True when the last ``step()`` updated the weights (a boundary step without overflow)."""
        return getattr(self, "_step_applied", False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradients: the optimizer's (with master copies) and every module parameter's."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        self.module.zero_grad(set_to_none=set_to_none)

    # ---- read-outs ---------------------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        # 0.0 for a group without a rate (a client optimizer with empty defaults), as DeepSpeed reports it
        return [group.get("lr", 0.0) for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> list[Any]:
        param_groups = self.optimizer.param_groups if self.optimizer is not None else []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Unscaled global gradient L2 norm of the last step (computed with clipping or loss scaling)."""
        return self.optimizer.global_grad_norm if self.optimizer is not None else None

    def get_loss_scale(self) -> float:
        return self.optimizer.loss_scale if self.optimizer is not None else 1.0

    # ---- checkpoints (deepspeed.runtime.checkpointing) ------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save module, optimizer, schedule and counters under ``<save_dir>/<tag>/`` (collective)."""
        from deepspeed.runtime import checkpointing
        from ds_zero.zero3.state_dict_hooks import partitioned_entries

        with partitioned_entries():  # ZeRO-3 model states: empty partitioned weights, gathered or not
            checkpointing.save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {},
                                          save_latest=save_latest,
                                          exclude_frozen_parameters=exclude_frozen_parameters)
        script = os.path.join(save_dir, "zero_to_fp32.py")  # ZeRO's recovery script, executable as in DeepSpeed
        if self.zero_optimization_stage() > 0 and self.global_rank == 0 and os.path.isfile(script):
            self._change_recovery_script_permissions(script)
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, dict | None]:
        """Restore a checkpoint; returns ``(path, client_state)`` (``(None, None)`` when there is none)."""
        from deepspeed.runtime import checkpointing

        if self.optimizer is not None:
            self._require_states_in_place("load_checkpoint")
        path, client_state = checkpointing.load_checkpoint(
            self, load_dir, tag=tag, load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        if path is not None and self.optimizer is not None and (load_module_only or not load_optimizer_states) \
                and self.zero3_scheduler is None:  # ZeRO-3 restored its fp32 masters from its files, not 16-bit
            self.optimizer.sync_master_from_model()  # the loaded weights, not the stale masters, go on training
        return path, client_state

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the module's (16-bit when training in fp16/bf16) weights to ``<save_dir>/<save_filename>``."""
        from deepspeed.runtime import checkpointing

        state_dict = None
        if self.zero3_scheduler is not None:  # ZeRO-3: gather the partitions, when the config allows it
            if not self.zero_gather_16bit_weights_on_model_save():
                log_dist(f"Did not save the model {os.path.join(save_dir, save_filename)} because "
                         "stage3_gather_16bit_weights_on_model_save is False", ranks=[0], level=logging.WARNING)
                return False
            state_dict = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        elif self.mp_world_size > 1:  # AutoTP: the full weights, gathered over the tensor group (collective)
            from deepspeed.runtime.autotp import full_module_state

            state_dict = full_module_state(self.module)
        return checkpointing.save_16bit_model(self, save_dir, save_filename,
                                              exclude_frozen_parameters=exclude_frozen_parameters,
                                              state_dict=state_dict)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The whole model's weights when they are partitioned (ZeRO-3) or sharded (AutoTP): what
        ``save_16bit_model`` writes and Accelerate's ``get_state_dict`` asks for. Collective; with AutoTP only
        global rank 0 gets the state dict, the others None (as in DeepSpeed)."""
        if self.zero3_scheduler is not None:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.mp_world_size > 1:
            from deepspeed.runtime.autotp import full_module_state

            state = full_module_state(self.module)
            if state is not None:
                if exclude_frozen_parameters:
                    frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
                    state = type(state)((k, v) for k, v in state.items() if k not in frozen)
                return state if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0 else None
        raise ValueError("_consolidated_16bit_state_dict: the weights are neither partitioned (ZeRO stage 3) nor "
                         "tensor-parallel sharded (tensor_parallel.autotp_size > 1); use engine.module.state_dict()")

    def compile(self, backend: Any = "inductor", compile_kwargs: dict[str, Any] = {},  # noqa: B006 (read only)
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """``torch.compile`` the wrapped module in place (``compile_kwargs`` over the ``compile`` section's
        ``kwargs``); with ``compile.deepcompile`` and ``passes: ["autosp"]``, through the AutoSP pass
        (``deepspeed.compile``). ``schedule`` and ``compiled_autograd_enabled`` are DeepCompile's ZeRO options."""
        from deepspeed.compile.engine import compile_engine

        compile_engine(self, backend, compile_kwargs, schedule, compiled_autograd_enabled)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_is_compiled", False)

    def destroy(self) -> None:
        """Remove the gradient hooks, close the monitors and free the optimizer's pinned host buffers (the
        engine must not be used afterwards)."""
        self._release_deepcompile()
        if "_hook_handles" not in self.__dict__:  # never set up (built with object.__new__): nothing else to free
            return
        self._release("destroy() was called")
        release_buffers = getattr(self.optimizer, "destroy", None)  # the ZeRO optimizers' (DeepSpeed's name)
        if callable(release_buffers):
            release_buffers()

    def _release(self, why: str) -> None:
        if self.zero3_scheduler is not None:
            self.zero3_scheduler.remove()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._released = why
        if self.optimizer is not None:
            from ds_zero.registry import release

            release(self.optimizer, self.module.parameters())
        if self.monitor is not None:
            self.monitor.close()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (nested tuples, lists, dicts such as Hugging Face's ModelOutput)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value

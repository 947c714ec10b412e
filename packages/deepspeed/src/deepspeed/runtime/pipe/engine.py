"""``PipelineEngine``: trains a ``PipelineModule`` with DeepSpeed's 1F1B schedule (``train_batch``) and runs it
forward only (``eval_batch``).

Each rank executes its stage's schedule (``ds_pipe.schedule``). Micro-batches come from the data iterator on the
first stage (the inputs, ``batch[0]``) and the last stage (the labels, ``batch[1]``); activations travel forward and
gradients backward through ``ds_pipe.p2p.StageLink``s. After the last micro-batch the gradients of tied weights
are summed over the stages that share them, all gradients are averaged over the data-parallel group (the same
stage of every pipeline), and the optimizer steps. Precision, loss scaling, clipping (one norm over every stage),
ZeRO-1, LR schedules, checkpoints and reports are the base engine's: this class only schedules.

A failure on one stage (an exception in a layer or the loss, a data iterator that runs dry, activations that
change shape without ``dynamic_shape``) is sent to the neighbouring stages, which raise it too and pass it on.
A stage that dies or stalls cannot send anything: ``train_batch``/``eval_batch`` run inside
``named_peer_failures``, so the transport error the others get becomes a ``PeerFailureError`` naming this rank,
the call, the global step and what is known of each peer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.optimizer_wrapper import trainable
from deepspeed.runtime.peer_failure import named_peer_failures
from deepspeed.runtime.pipe import _checkpoint, clipping
from ds_config import ConfigError, ConfigProblem
from ds_pipe import module as pipe_module
from ds_pipe import schedule
from ds_pipe.module import PipelineError, PipelineModule
from ds_pipe.p2p import LinkConfig, PipelineAbort, StageLink
from ds_pipe.topology import PipelineParallelGrid

_TRAIN_ONLY = "Only train_batch() is accessible in pipeline mode."
_INLINE = 8  # values broadcast in the same message as their shape (_broadcast_from_last)


def pipeline_mpu(module: PipelineModule, mpu: Any = None) -> PipelineParallelGrid:
    """The grid a ``PipelineModule`` trains on (its own; built now for a module made before a single-process
    ``torch.distributed`` was initialised)."""
    if mpu is not None:
        raise ValueError("deepspeed.initialize: mpu must be None for a PipelineModule: its process groups come from "
                         "the module's topology (PipelineModule(topology=...))")
    grid = module.mpu()
    if grid is not None:
        return grid
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != module.topology().world_size():
        raise ValueError(f"deepspeed.initialize: the PipelineModule was built before torch.distributed was "
                         f"initialised (for {module.topology().world_size()} process) but this job has {world} "
                         "ranks: call deepspeed.init_distributed() before building the PipelineModule")
    module._grid = PipelineParallelGrid(topology=module.topology())
    return module._grid


class PipelineEngine(DeepSpeedEngine):
    """A training engine for pipeline-parallel models (built by ``deepspeed.initialize`` for a ``PipelineModule``).

    ``has_bool_tensors`` is accepted for DeepSpeed compatibility: boolean activations always travel (as uint8)."""

    pipeline_parallelism = True

    def __init__(self, model: PipelineModule, config: Any, *args: Any, has_bool_tensors: bool = False,
                 **kwargs: Any) -> None:
        if not isinstance(model, PipelineModule):
            raise TypeError(f"PipelineEngine: model must be a PipelineModule, got {type(model).__name__}")
        grid = kwargs.pop("mpu", None)
        grid = grid if isinstance(grid, PipelineParallelGrid) and grid is model.mpu() else pipeline_mpu(model, grid)
        _apply_pipeline_config(model, config)
        super().__init__(model, config, *args, mpu=grid, **kwargs)
        self.grid = grid
        self.has_bool_tensors = has_bool_tensors
        self.num_stages = model.num_stages
        self.stage_id = model.stage_id
        self.micro_batches = self.gradient_accumulation_steps()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.total_loss: torch.Tensor | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.outputs: Any = None
        self.eval_return_logits = False
        self._compute_loss = True
        self.pipe_buffers: dict[str, list[Any]] = {}
        self._links = self._build_links(model, config)
        self._links_grad_mode: bool | None = None  # the grad mode of the last schedule
        self._clip_in_bf16 = clipping.clips_bf16_grads(self.optimizer, self.zero_optimization_stage(),
                                                       self.gradient_clipping())
        if self.training_dataloader is not None and (self.is_first_stage() or self.is_last_stage()):
            from deepspeed.runtime.dataloader import RepeatingLoader

            self.set_dataiterator(RepeatingLoader(self.training_dataloader))
        self.checkpoint_shards = (*_checkpoint.stage_shards(self), *self.checkpoint_shards)

    def _build_links(self, model: PipelineModule, config: Any) -> dict[str, StageLink]:
        grid, links = self.grid, {}
        sliced = grid.get_slice_parallel_world_size() > 1
        for name, stage in (("prev", self.stage_id - 1), ("next", self.stage_id + 1)):
            if 0 <= stage < self.num_stages:  # both ends of a link split activations and gradients alike
                links[name] = StageLink(LinkConfig(
                    stage=self.stage_id, peer_stage=stage, peer_rank=grid.stage_to_global(stage), device=self.device,
                    dynamic_shape=model.dynamic_shape, slice_group=grid.get_slice_parallel_group(),
                    partitioned=sliced and config.pipeline.pipe_partitioned,
                    grad_partitioned=sliced and config.pipeline.grad_partitioned))
        return links

    # ---- the documented interface ----------------------------------------------------------------------------
    def set_train_batch_size(self, train_batch_size: int) -> None:
        """As the engine's; ``train_batch`` then runs the new number of micro-batches."""
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _reentrant_activation_checkpointing(self) -> bool:
        """DeepSpeed's query: whether the module now checkpoints with a function other than the non-reentrant
        one (read from the module, so ``set_checkpoint_interval`` after ``initialize`` counts). DeepSpeed then
        makes the first stage's inputs require grad; here ``deepspeed.checkpointing.checkpoint`` is itself
        non-reentrant, so the inputs are loaded as they are either way."""
        from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

        return self.module.activation_checkpoint_interval > 0 \
            and self.module.activation_checkpoint_func is not non_reentrant_checkpoint

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """Where the first and last stages read micro-batches (``(inputs, labels)`` pairs); other stages ignore it."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        """Read micro-batches from ``loader`` (one pass: ``iter(loader)``) on the first and last stages."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn`` to every batch read from the data iterator before it is used."""
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """Exchange the activation shapes again at the next send (after changing the micro-batch shape)."""
        for link in self._links.values():
            link.reset_shapes()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_TRAIN_ONLY)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_TRAIN_ONLY)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_TRAIN_ONLY)

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one batch (``gradient_accumulation_steps`` micro-batches) and step the optimizer; returns the
        batch's mean loss, averaged over the data-parallel group, on every stage."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        self._require_optimizer("train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        with named_peer_failures(self.global_steps, "train_batch"):
            return self._train_batch()

    def _train_batch(self) -> torch.Tensor:
        self.module.train()
        self.total_loss = None
        self._compute_loss = True
        sched = schedule.TrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                       stage_id=self.stage_id)
        self._boundary_override = False
        try:
            self._exec_schedule(sched)
        finally:
            self._boundary_override = None
        self.agg_train_loss = self._aggregate_total_loss()
        self._record_loss(self.agg_train_loss)
        self._after_model_step()
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward ``num_micro_batches`` (default ``gradient_accumulation_steps``) micro-batches through the
        pipeline without gradients. Returns the loss (``compute_loss``; else the model's outputs) averaged over
        micro-batches and data-parallel ranks (``reduce_output='avg'``; ``None``: the list of per-micro-batch
        values), broadcast to every stage with ``bcast_loss``; with ``return_logits`` also the last micro-batch's
        outputs (on the last stage)."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): accepted: 'avg' or None")
        with named_peer_failures(self.global_steps, "eval_batch"):
            return self._eval_batch(data_iter, return_logits, compute_loss, reduce_output, bcast_loss,
                                    num_micro_batches)

    def _eval_batch(self, data_iter: Iterator[Any], return_logits: bool, compute_loss: bool,
                    reduce_output: str | None, bcast_loss: bool, num_micro_batches: int | None) -> Any:
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        self.eval_return_logits = return_logits
        self._compute_loss = compute_loss
        self.module.eval()
        train_iterator, self._fwd_outputs = self.data_iterator, []
        self.set_dataiterator(data_iter)
        sched = schedule.InferenceSchedule(micro_batches=micro_batches, stages=self.num_stages,
                                           stage_id=self.stage_id)
        try:
            with torch.no_grad():
                self._exec_schedule(sched)
        finally:
            self.module.train()
            self.set_dataiterator(train_iterator)
            self.eval_return_logits = False
        output = None
        if self.is_last_stage():
            output = self._reduce_outputs(self._fwd_outputs, reduce_output, micro_batches)
        if compute_loss and bcast_loss:
            output = self._broadcast_from_last(output)
        if self.monitor is not None and self.global_rank == 0 and isinstance(output, torch.Tensor) \
                and output.numel() == 1:
            self.monitor.write_events([("Train/Samples/eval_loss", float(output), self.global_samples)])
        self._fwd_outputs = []
        if return_logits:
            outputs, self.outputs = self.outputs, None
            return output, outputs
        return output

    # ---- the schedule ----------------------------------------------------------------------------------------
    def _exec_schedule(self, sched: schedule.PipeSchedule) -> None:
        self.pipe_buffers: dict[str, list[Any]] = {key: [None] * sched.num_pipe_buffers()
                                               for key in ("inputs", "labels", "outputs", "output_grads")}
        self._loaded = 0
        self._micro_batches_now = sched.micro_batches
        if torch.is_grad_enabled() != self._links_grad_mode:
            # train_batch and eval_batch send different requires_grad flags: both ends of every link start
            # again from a control message here, at the same point of the call sequence
            self.reset_activation_shape()
            self._links_grad_mode = torch.is_grad_enabled()
        try:
            for step_cmds in sched:
                for cmd in step_cmds:
                    handler = _INSTRUCTIONS.get(type(cmd))
                    if handler is None:
                        raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {cmd!r}")
                    handler(self, **cmd.kwargs)
            for link in self._links.values():
                link.flush()
        except PipelineAbort as exc:
            self._abort_links(str(exc), skip_rank=exc.from_rank)
            raise
        except Exception as exc:
            message = (f"pipeline stage {self.stage_id} (rank {self.global_rank}) failed: "
                       f"{type(exc).__name__}: {exc}")
            self._abort_links(message)
            raise
        finally:
            self.pipe_buffers = {}  # activations and gradients do not outlive the batch

    def _abort_links(self, message: str, skip_rank: int | None = None) -> None:
        for link in self._links.values():
            if link.config.peer_rank != skip_rank:
                link.abort(message)

    def _next_batch(self) -> Any:
        if self.data_iterator is None:
            raise PipelineError(f"pipeline stage {self.stage_id} reads micro-batches but has no data iterator: pass "
                                "data_iter to train_batch()/eval_batch(), training_data to deepspeed.initialize, or "
                                "call engine.set_dataiterator()")
        try:
            batch = next(self.data_iterator)
        except StopIteration:
            raise PipelineError(f"the data iterator ran out after {self._loaded} of the {self._micro_batches_now} "
                                f"micro-batches of this batch (pipeline stage {self.stage_id}); a batch reads "
                                "gradient_accumulation_steps micro-batches: give a longer iterator or wrap the "
                                "loader in deepspeed.utils.RepeatingLoader") from None
        self._loaded += 1
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise TypeError(f"pipeline stage {self.stage_id}: a micro-batch must be an (inputs, labels) pair, got "
                            f"{type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list))
                                                         else ""))
        return batch

    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        batch = self._next_batch()
        if self.is_first_stage():
            self.pipe_buffers["inputs"][buffer_id] = _to_device(batch[0], self.device)
        if self.is_last_stage():
            self.pipe_buffers["labels"][buffer_id] = _to_device(batch[1], self.device)

    def _exec_forward_pass(self, buffer_id: int) -> None:
        outputs = DeepSpeedEngine.forward(self, self.pipe_buffers["inputs"][buffer_id])
        if torch.is_grad_enabled():
            self.micro_steps += 1
        if not self.is_last_stage():
            self.pipe_buffers["outputs"][buffer_id] = outputs
            return
        if self.eval_return_logits:
            self.outputs = outputs
        loss = outputs
        if self._compute_loss and self.module.loss_fn is not None:
            loss = self.module.loss_fn(outputs, self.pipe_buffers["labels"][buffer_id])
        if torch.is_grad_enabled():
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError("the last pipeline stage must produce a scalar loss tensor for training (loss_fn("
                                "outputs, labels), or the last layer's output without a loss_fn), got "
                                f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
            detached = loss.detach().float().reshape(())
            self.total_loss = detached if self.total_loss is None else self.total_loss + detached
            self.pipe_buffers["outputs"][buffer_id] = loss
        else:
            self._fwd_outputs.append(_detach(loss))

    def _exec_backward_pass(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.is_last_stage():
            gas = self._micro_batches_now
            scaled = self.optimizer.scale_loss(outputs / gas if gas > 1 else outputs)
            self._run_backward(scaled.backward)
        else:
            tensors = [t for t in _as_tuple(outputs) if t.requires_grad]
            grads = self.pipe_buffers["output_grads"][buffer_id]
            self._run_backward(lambda: torch.autograd.backward(tensors, grad_tensors=grads))
        self.pipe_buffers["outputs"][buffer_id] = self.pipe_buffers["output_grads"][buffer_id] = None

    def _exec_send_activations(self, buffer_id: int) -> None:
        self._links["next"].send(self.pipe_buffers["outputs"][buffer_id])
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id: int) -> None:
        self.pipe_buffers["inputs"][buffer_id] = self._links["prev"].recv()

    def _exec_send_grads(self, buffer_id: int) -> None:
        inputs = [t for t in _as_tuple(self.pipe_buffers["inputs"][buffer_id]) if t.requires_grad]
        self._links["prev"].send_grads([t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs])
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id: int) -> None:
        like = [t for t in _as_tuple(self.pipe_buffers["outputs"][buffer_id]) if t.requires_grad]
        self.pipe_buffers["output_grads"][buffer_id] = self._links["next"].recv_grads(like)

    def _exec_reduce_tied_grads(self) -> None:
        """Sum each tied weight's gradient over the stages that hold it (before the data-parallel average)."""
        for weight, group in self.module.get_tied_weights_and_groups():
            if not weight.requires_grad:
                continue
            if self.optimizer.get_grad(weight) is None:
                self.optimizer.set_grad(weight, torch.zeros_like(weight, dtype=self.optimizer.grad_dtype(weight)))
            dist.all_reduce(self.optimizer.get_grad(weight), group=group)

    def _exec_reduce_grads(self) -> None:
        """Average the accumulated gradients over the data-parallel group (this stage in every pipeline)."""
        if not (self.reducer.every_micro_step or self.dp_world_size > 1):
            return
        self._boundary_override = True
        self._syncing = True
        try:
            for p in reversed(trainable(self.module.parameters())):
                self.reducer.grad_ready(p)
            self._end_of_backward()
        finally:
            self._syncing = False
            self._boundary_override = False

    def _exec_optimizer_step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        self._boundary_override = True
        try:
            self._step_applied = False
            if self._clip_in_bf16:
                self._take_bf16_clipped_step(lr_kwargs)
            else:
                self._take_model_step(lr_kwargs)
        finally:
            self._boundary_override = False

    def _take_bf16_clipped_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        """bf16 with bf16 gradients: clip them before the optimizer upcasts them, as DeepSpeed's pipeline does
        (``clipping``), and step without the optimizer's own clipping."""
        norm = clipping.clip_bf16_grads(self.optimizer, self.gradient_clipping(), self.device)
        clip, self.optimizer.clip = self.optimizer.clip, 0.0
        try:
            self._take_model_step(lr_kwargs)
        finally:
            self.optimizer.clip = clip
        self.optimizer.global_grad_norm = norm

    # ---- results ---------------------------------------------------------------------------------------------
    def _aggregate_total_loss(self) -> torch.Tensor:
        """The last stage's mean loss over micro-batches and data-parallel ranks, broadcast to every stage."""
        loss = None
        if self.is_last_stage():
            loss = self.total_loss / self._micro_batches_now
            if self.dp_world_size > 1:
                loss = loss.to(self.device)
                dist.all_reduce(loss, group=self.dp_group)
                loss = loss / self.dp_world_size
        return self._broadcast_from_last(loss)

    def _reduce_outputs(self, outputs: list[Any], reduce: str | None, micro_batches: int) -> Any:
        if reduce is None:
            return outputs
        total = outputs[0]
        for value in outputs[1:]:
            total = _zip_map(lambda a, b: a + b, total, value)
        mean = _zip_map(lambda a, _: a / micro_batches, total, total)
        if self.dp_world_size <= 1:
            return mean

        def dp_average(t: torch.Tensor, _: Any) -> torch.Tensor:
            t = t.float().to(self.device) if not t.is_floating_point() else t.clone()
            dist.all_reduce(t, group=self.dp_group)
            return t / self.dp_world_size

        return _zip_map(dp_average, mean, mean)

    def _broadcast_from_last(self, value: Any) -> Any:
        """``value`` (a tensor on the last stage) on every stage of this pipeline; non-tensors stay where they are."""
        if self.num_stages == 1:
            return value
        group, src = self.grid.get_pipe_parallel_group(), self.grid.stage_to_global(self.num_stages - 1)
        # one float64 packet: is-tensor, ndim, up to 7 dims, then the values when there are at most _INLINE of
        # them (a loss: float32 values and small integers are exact in float64), else a second broadcast
        packet = torch.zeros(9 + _INLINE, dtype=torch.float64, device=self.device)
        data = None
        if self.is_last_stage() and isinstance(value, torch.Tensor) and value.dim() <= 7:
            data = value.detach().float().to(self.device).contiguous()
            packet[0], packet[1] = 1, value.dim()
            packet[2:2 + value.dim()] = torch.tensor(value.shape, dtype=torch.float64)
            if data.numel() <= _INLINE:
                packet[9:9 + data.numel()] = data.reshape(-1)
        dist.broadcast(packet, src=src, group=group)
        if not int(packet[0]):
            return value
        shape = tuple(int(v) for v in packet[2:2 + int(packet[1])])
        numel = math.prod(shape)
        if data is not None and numel > _INLINE:
            dist.broadcast(data, src=src, group=group)
        elif numel > _INLINE:
            data = torch.empty(shape, dtype=torch.float32, device=self.device)
            dist.broadcast(data, src=src, group=group)
        elif data is None:
            data = packet[9:9 + numel].to(torch.float32).reshape(shape)
        return data

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def load_checkpoint(self, load_dir: str, tag: Any = None, **kwargs: Any) -> tuple[str | None, dict | None]:
        """As the base engine's; a checkpoint saved with another stage layout restores the weights layer by layer
        and the optimizer state parameter by parameter (see ``_checkpoint``)."""
        return _checkpoint.load(self, super().load_checkpoint, load_dir, tag, **kwargs)


_INSTRUCTIONS: dict[type, Callable[..., None]] = {
    schedule.LoadMicroBatch: PipelineEngine._exec_load_micro_batch,
    schedule.ForwardPass: PipelineEngine._exec_forward_pass,
    schedule.BackwardPass: PipelineEngine._exec_backward_pass,
    schedule.SendActivation: PipelineEngine._exec_send_activations,
    schedule.RecvActivation: PipelineEngine._exec_recv_activations,
    schedule.SendGrad: PipelineEngine._exec_send_grads,
    schedule.RecvGrad: PipelineEngine._exec_recv_grads,
    schedule.ReduceTiedGrads: PipelineEngine._exec_reduce_tied_grads,
    schedule.ReduceGrads: PipelineEngine._exec_reduce_grads,
    schedule.OptimizerStep: PipelineEngine._exec_optimizer_step,
}


def _apply_pipeline_config(model: PipelineModule, config: Any) -> None:
    """The ``pipeline`` section: ``stages`` must match the module; ``activation_checkpoint_interval`` > 0 overrides
    the module's; ``partition`` and ``seed_layers``, set explicitly, must match how the module was built."""
    config.check_pipeline(model.num_stages)
    section = config.pipeline
    problems = []
    if section.stages != "auto" and section.stages != model.num_stages:
        problems.append(ConfigProblem("pipeline.stages", f"the PipelineModule has {model.num_stages} stages; "
                                      f"accepted: {model.num_stages} or \"auto\"", section.stages))
    explicit = section.model_fields_set
    if "partition" in explicit and section.partition.lower() != str(model.partition_method).lower():
        problems.append(ConfigProblem("pipeline.partition", "the PipelineModule was already partitioned with "
                                      f"partition_method={model.partition_method!r}; pass the method to "
                                      "PipelineModule(partition_method=...) or make them agree",
                                      section.partition))
    if "seed_layers" in explicit and section.seed_layers != model.seed_layers:
        problems.append(ConfigProblem("pipeline.seed_layers", "the PipelineModule was built with "
                                      f"seed_layers={model.seed_layers}; pass it to PipelineModule(seed_layers=...)",
                                      section.seed_layers))
    if problems:
        raise ConfigError(*problems)
    if section.activation_checkpoint_interval > 0:
        model.set_checkpoint_interval(section.activation_checkpoint_interval)
    if section.use_reentrant is False:  # as DeepSpeed: the config's choice replaces any module's function
        from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

        model.activation_checkpoint_func = non_reentrant_checkpoint
    elif model.activation_checkpoint_func is pipe_module.checkpoint:
        # ds-pipe cannot import deepspeed, so its default is torch's checkpoint; under the engine, DeepSpeed's
        # default (deepspeed.checkpointing: the RNG tracker, partition_activations, checkpoint_in_cpu) takes over
        from deepspeed import checkpointing

        model.activation_checkpoint_func = checkpointing.checkpoint


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else tuple(value) if isinstance(value, list) else (value,)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return tuple(_to_device(v, device) for v in value)
    return value


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


def _zip_map(fn: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    if isinstance(a, (tuple, list)):
        return type(a)(_zip_map(fn, x, y) for x, y in zip(a, b, strict=True))
    return fn(a, b)

"""Pipeline schedules: plain iterables of instruction lists (served as ``deepspeed.runtime.pipe.schedule``).

A schedule tells one pipeline stage what to do at each step of a batch: load a micro-batch, run a forward or
backward pass, exchange activations or gradients with a neighbouring stage, and reduce gradients and step the
optimizer at the end. Each yielded step is atomic: a barrier between successive steps cannot deadlock, because
every blocking send on one stage is paired with its receive on the neighbour in the same step.

The step -> (micro-batch, forward/backward) mapping, the buffer ids and the order of instructions inside a step
are DeepSpeed's, exactly: pipeline checkpoints, logs and the pipeline engine depend on that order. In closed
form, :class:`TrainSchedule` runs the forward pass of micro-batch ``i`` on stage ``s`` at step ``2*i + s`` and
its backward pass at step ``2*i + 2*stages - 1 - s`` (synchronous 1F1B), over ``2 * (micro_batches + stages - 1)``
steps, so every stage idles ``(stages - 1) / (micro_batches + stages - 1)`` of the steps.

Building a schedule needs no process group: tests and tools read the instructions directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

__all__ = [
    "PipeSchedule",
    "InferenceSchedule",
    "TrainSchedule",
    "DataParallelSchedule",
    "PipeInstruction",
    "OptimizerStep",
    "ReduceGrads",
    "ReduceTiedGrads",
    "BufferOpInstruction",
    "LoadMicroBatch",
    "ForwardPass",
    "BackwardPass",
    "SendActivation",
    "RecvActivation",
    "SendGrad",
    "RecvGrad",
]


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def _check_schedule_args(micro_batches: int, stages: int, stage_id: int) -> None:
    """Raise a ValueError/TypeError naming the argument that cannot describe a pipeline."""
    for name, value in (("micro_batches", micro_batches), ("stages", stages), ("stage_id", stage_id)):
        _check_int(name, value)
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if not 0 <= stage_id < stages:
        raise ValueError(f"stage_id must be in [0, stages) = [0, {stages}), got {stage_id}")


def _is_even(x: int) -> bool:
    return x % 2 == 0


def _is_odd(x: int) -> bool:
    return x % 2 != 0


class PipeSchedule(ABC):
    """Directs the execution of a pipeline engine by generating sequences of :class:`PipeInstruction`.

    ``steps()`` yields one list of instructions per step; iterating the schedule itself does the same (each
    ``iter()`` starts over).

    Args:
        micro_batches: the number of micro-batches that make up one batch (at least 1).
        stages: the number of pipeline stages (at least 1).
        stage_id: the stage that executes this schedule, in ``[0, stages)``.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__()
        _check_schedule_args(micro_batches, stages, stage_id)
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1
        self.it: Iterator[list[PipeInstruction]] | None = None

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield a list of :class:`PipeInstruction` for each step in the schedule."""

    def num_pipe_buffers(self) -> int:
        """The number of pipeline buffers this stage uses (subclasses specialise it to save memory)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    @property
    def stage(self) -> int:
        """Stage index used to configure this schedule."""
        return self.stage_id

    @property
    def num_stages(self) -> int:
        """The number of total pipeline stages used to configure this schedule."""
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        """The number of total micro-batches used to configure this schedule."""
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        """True if the configured ``stage_id`` is the first stage in the pipeline."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """True if the configured ``stage_id`` is the last stage in the pipeline."""
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id: int) -> int:
        """The buffer that holds ``micro_batch_id`` (cyclic allocation over ``num_pipe_buffers()``)."""
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro_batch_id must be in [0, {self.micro_batches}), got {micro_batch_id}")
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(micro_batches={self.micro_batches}, stages={self.stages}, "
                f"stage_id={self.stage_id})")


class InferenceSchedule(PipeSchedule):
    """A schedule for inferencing batches using pipeline parallelism (forward passes only, two buffers)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total_steps = self.micro_batches + self.stages - 1
        for step_id in range(total_steps):
            cmds: list[PipeInstruction] = []
            micro_batch_id = step_id - self.stage_id

            # Alternate send/recv buffers; even and odd stages swap roles so neighbours pair up.
            if _is_even(self.stage_id):
                recv_buf = step_id % 2
                send_buf = (step_id + 1) % 2
            else:
                recv_buf = (step_id + 1) % 2
                send_buf = step_id % 2

            if self.is_first_stage or self.is_last_stage:
                if self._valid_micro_batch(micro_batch_id):
                    cmds.append(LoadMicroBatch(recv_buf))

            send: list[PipeInstruction] = []
            recv: list[PipeInstruction] = []
            if self._valid_stage(self.next_stage) and self._valid_micro_batch(micro_batch_id - 1):
                send.append(SendActivation(send_buf))
            if self._valid_stage(self.prev_stage) and self._valid_micro_batch(micro_batch_id):
                recv.append(RecvActivation(recv_buf))
            # Even stages send before they receive, odd stages receive first: blocking pairs never cross.
            cmds.extend(send + recv if _is_even(self.stage_id) else recv + send)

            if self._valid_micro_batch(micro_batch_id):
                cmds.append(ForwardPass(recv_buf))

            yield cmds

    def num_pipe_buffers(self) -> int:
        """Only two pipeline buffers are required for inferencing: ``2``."""
        return 2


class TrainSchedule(PipeSchedule):
    """A schedule for training a batch using hybrid parallelism (synchronous 1F1B).

    Pipeline parallelism is extracted through gradient accumulation and thus convergence follows that of a
    data parallel approach with the same batch size.
    """

    def steps(self) -> Iterator[list[PipeInstruction]]:
        prev_micro_batch_id = -1
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        for step_id in range(total_steps):
            # Map the step of the pipeline to the micro-batch id and whether it is a forward or backward step.
            micro_batch_id, is_forward = self._step_to_micro_batch(step_id)
            cmds = self._exchange(micro_batch_id, prev_micro_batch_id, is_forward)

            valid = self._valid_micro_batch(micro_batch_id)
            curr_buffer = self._buffer_idx(micro_batch_id) if valid else -1
            # First/last stage loads (inputs on the first, labels on the last).
            if (self.is_first_stage or self.is_last_stage) and is_forward and valid:
                cmds.append(LoadMicroBatch(curr_buffer))
            # Computation
            if valid:
                cmds.append(ForwardPass(curr_buffer) if is_forward else BackwardPass(curr_buffer))
            # Model step at the end of the batch
            if step_id == total_steps - 1:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])

            prev_micro_batch_id = micro_batch_id
            yield cmds

    def _exchange(self, micro_batch_id: int, prev_micro_batch_id: int, is_forward: bool) -> list[PipeInstruction]:
        """The communication that opens a step: in a forward step, the gradient of the previous (backward)
        step goes back and this step's activation comes in; in a backward step, this step's gradient comes in
        and the previous (forward) step's activation goes out."""
        cmds: list[PipeInstruction] = []
        curr_valid = self._valid_micro_batch(micro_batch_id)
        prev_valid = self._valid_micro_batch(prev_micro_batch_id)
        if is_forward:
            if prev_valid and self._valid_stage(self.prev_stage):
                cmds.append(SendGrad(self._buffer_idx(prev_micro_batch_id)))
            if curr_valid and self._valid_stage(self.prev_stage):
                cmds.append(RecvActivation(self._buffer_idx(micro_batch_id)))
        else:
            if curr_valid and self._valid_stage(self.next_stage):
                cmds.append(RecvGrad(self._buffer_idx(micro_batch_id)))
            if prev_valid and self._valid_stage(self.next_stage):
                cmds.append(SendActivation(self._buffer_idx(prev_micro_batch_id)))
        return cmds

    def num_pipe_buffers(self) -> int:
        """The number of pipeline buffers this stage needs: the most forward passes in flight, which for
        synchronous 1F1B is ``min(stages - stage_id, micro_batches)``; DeepSpeed allocates at least 2."""
        buffers = min(self.stages - self.stage_id, self.micro_batches)
        return max(2, buffers)

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """(micro-batch id, is_forward) of a step: a stage runs forward passes on the steps of its own parity
        and backward passes on the others. The id may lie outside ``[0, micro_batches)`` (an idle step)."""
        if _is_even(step_id) and _is_even(self.stage_id):
            return self._even_step_forward_id(step_id), True
        if _is_odd(step_id) and _is_odd(self.stage_id):
            return self._odd_step_forward_id(step_id), True
        if _is_even(step_id) and _is_odd(self.stage_id):
            return self._even_step_backward_id(step_id), False
        return self._odd_step_backward_id(step_id), False

    def _even_step_forward_id(self, step_id: int) -> int:
        base = step_id // 2
        return int(base - self.stage_id // 2)

    def _odd_step_forward_id(self, step_id: int) -> int:
        base = (step_id - 1) // 2
        return int(base - self.stage_id // 2)

    def _even_step_backward_id(self, step_id: int) -> int:
        base = step_id // 2
        return int(base - self.stages + (self.stage_id + 1) // 2)

    def _odd_step_backward_id(self, step_id: int) -> int:
        base = ((step_id - 1) // 2) - self.stages + 1
        return int(base + self.stage_id // 2)


class DataParallelSchedule(PipeSchedule):
    """An example schedule that trains using traditional data parallelism with gradient accumulation."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [
                LoadMicroBatch(buffer_id=0),
                ForwardPass(buffer_id=0),
                BackwardPass(buffer_id=0),
            ]
            if step_id == self.micro_batches - 1:
                cmds.extend([
                    ReduceGrads(),
                    OptimizerStep(),
                ])
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Only one pipeline buffer needed."""
        return 1


def _call_to_str(base: str, **kwargs: Any) -> str:
    """``base(key=value, ...)`` with ``repr`` values, as DeepSpeed's ``call_to_str``."""
    return f"{base}({', '.join(f'{key}={value!r}' for key, value in kwargs.items())})"


class PipeInstruction:
    """Base class for all instructions to be executed by the pipeline engine.

    All keyword arguments are stored as members, similar to a ``namedtuple``, and in ``kwargs``; ``name`` is
    the class name. Two instructions are equal when they have the same class and the same keyword arguments
    (DeepSpeed compares by identity; value equality lets schedules be compared as lists).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.name = self.__class__.__name__
        self.kwargs = kwargs
        for key, val in kwargs.items():
            setattr(self, key, val)

    def __repr__(self) -> str:
        return _call_to_str(self.name, **self.kwargs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PipeInstruction):
            return NotImplemented
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self) -> int:
        # Keys only: equal instructions hash alike, and unhashable argument values never break hashing.
        return hash((type(self), tuple(sorted(self.kwargs))))


class OptimizerStep(PipeInstruction):
    """Performs one step with the optimizer and zeros gradients.

    Issued after :class:`ReduceGrads` and :class:`ReduceTiedGrads`; can be a synchronization point among
    data-parallel ranks.
    """


class ReduceGrads(PipeInstruction):
    """Reduce the computed gradients among data-parallel processes within the stage."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the computed gradients of tied modules within a pipeline-parallel group.

    The stages in this synchronization point are known only once the model is partitioned (in the worst
    case, all stages), so schedule it carefully to avoid deadlocks.
    """


class BufferOpInstruction(PipeInstruction):
    """A pipeline instruction that operates on pipeline buffer(s).

    Args:
        buffer_id: the index of the pipeline buffer to modify.
    """

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Load a micro-batch into a buffer: ``buffers['inputs'][buffer_id] = next(data_iter)``."""


class ForwardPass(BufferOpInstruction):
    """Compute a forward pass: ``buffers['outputs'][buffer_id] = forward(buffers['inputs'][buffer_id])``."""


class BackwardPass(BufferOpInstruction):
    """Compute a backward pass and accumulate gradients: ``torch.autograd.backward(
    tensors=buffers['outputs'][buffer_id], grad_tensors=buffers['gradients'][buffer_id])``."""


class SendActivation(BufferOpInstruction):
    """Send activations to the next stage: ``send(buffers['outputs'][buffer_id])``.

    Blocking: paired with a :class:`RecvActivation` on the next stage in the same step.
    """


class RecvActivation(BufferOpInstruction):
    """Receive activations from the previous stage: ``buffers['inputs'][buffer_id] = recv()``.

    Blocking: paired with a :class:`SendActivation` on the previous stage in the same step.
    """


class SendGrad(BufferOpInstruction):
    """Send the gradients with respect to the received activations to the previous stage.

    Only received tensors with ``requires_grad=True`` produce gradients; missing ones arrive as ``None``.
    Blocking: paired with a :class:`RecvGrad` on the previous stage in the same step.
    """


class RecvGrad(BufferOpInstruction):
    """Receive computed gradients from the next stage.

    Only activations with ``requires_grad=True`` produce gradients; missing ones are ``None``.
    Blocking: paired with a :class:`SendGrad` on the next stage in the same step.
    """

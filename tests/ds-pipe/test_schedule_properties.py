"""Properties of the pipeline schedules over stages and micro-batches, and a simulation that steps every stage
together: blocking sends and receives meet in each step (a barrier between steps never deadlocks), buffers are
never overwritten while live, each stage sees micro-batches in order, and the bubble is (p-1)/(m+p-1).

The plain reference is the closed form of synchronous 1F1B: forward of micro-batch i on stage s at step 2i+s,
its backward at step 2i+2p-1-s.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipe.schedule import (
    BackwardPass,
    BufferOpInstruction,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

STAGES = st.integers(1, 8)
MICRO_BATCHES = st.integers(1, 16)
# a blocking communication instruction -> (direction of the peer stage, the instruction it must meet there)
PEER = {SendActivation: (1, RecvActivation), RecvActivation: (-1, SendActivation),
        SendGrad: (-1, RecvGrad), RecvGrad: (1, SendGrad)}


class Deadlock(AssertionError):
    pass


class _StageSim:
    """One stage's buffers, with DeepSpeed's engine semantics reduced to micro-batch ids; every read checks the
    buffer still holds the micro-batch it should, and every write checks the slot is free."""

    def __init__(self, schedule: PipeSchedule) -> None:
        self.s = schedule
        self.inputs: dict[int, int] = {}
        self.labels: dict[int, int] = {}
        self.outputs: dict[int, int] = {}
        self.out_grads: dict[int, int] = {}
        self.in_grads: dict[int, int] = {}
        self.loaded = 0
        self.log: list[tuple[str, int, int]] = []  # (forward/backward, micro-batch, step)
        self.peak_in_flight = 0

    def _fill(self, slots: dict[int, int], buffer_id: int, mb: int, what: str) -> None:
        assert buffer_id not in slots, f"stage {self.s.stage_id}: {what}[{buffer_id}] overwritten while live"
        assert 0 <= buffer_id < self.s.num_pipe_buffers()
        slots[buffer_id] = mb

    def load(self, cmd: LoadMicroBatch) -> None:
        if self.s.is_first_stage:
            self._fill(self.inputs, cmd.buffer_id, self.loaded, "inputs")
        if self.s.is_last_stage:
            self.labels[cmd.buffer_id] = self.loaded
        self.loaded += 1

    def forward(self, cmd: ForwardPass, step: int) -> None:
        mb = self.inputs[cmd.buffer_id]
        if self.s.is_last_stage:
            assert self.labels.pop(cmd.buffer_id) == mb, "labels and inputs of different micro-batches"
        training = isinstance(self.s, TrainSchedule)
        if training or not self.s.is_last_stage:  # held for the backward pass, or until sent on
            self._fill(self.outputs, cmd.buffer_id, mb, "outputs")
        if not training:  # inference keeps no input once its forward ran
            del self.inputs[cmd.buffer_id]
        self.log.append(("forward", mb, step))
        self.peak_in_flight = max(self.peak_in_flight, len(self.outputs))

    def backward(self, cmd: BackwardPass, step: int) -> None:
        mb = self.outputs.pop(cmd.buffer_id)
        if not self.s.is_last_stage:
            assert self.out_grads.pop(cmd.buffer_id) == mb, "gradient of another micro-batch"
        assert self.inputs[cmd.buffer_id] == mb
        if self.s.is_first_stage:
            del self.inputs[cmd.buffer_id]  # nothing to send back: the input is free
        else:
            self.in_grads[cmd.buffer_id] = mb
        self.log.append(("backward", mb, step))

    def send(self, cmd: BufferOpInstruction) -> int:
        if isinstance(cmd, SendActivation):
            mb = self.outputs[cmd.buffer_id]
            if isinstance(self.s, InferenceSchedule):
                del self.outputs[cmd.buffer_id]
            return mb
        mb = self.in_grads.pop(cmd.buffer_id)
        assert self.inputs.pop(cmd.buffer_id) == mb, "input overwritten before its gradient was sent"
        return mb

    def receive(self, cmd: BufferOpInstruction, mb: int) -> None:
        if isinstance(cmd, RecvActivation):
            self._fill(self.inputs, cmd.buffer_id, mb, "inputs")
        else:
            self._fill(self.out_grads, cmd.buffer_id, mb, "gradients")


def _run_step(sims: list[_StageSim], cmds: list[list], step: int) -> None:
    """Execute one step on all stages; a send blocks until its peer's next instruction is the matching
    receive (one ordered link per pair of neighbours), compute runs at once."""
    pcs = [0] * len(sims)
    while any(pc < len(c) for pc, c in zip(pcs, cmds, strict=True)):
        progressed = False
        for s, sim in enumerate(sims):
            if pcs[s] >= len(cmds[s]):
                continue
            cmd = cmds[s][pcs[s]]
            if type(cmd) in PEER:
                delta, partner = PEER[type(cmd)]
                peer = s + delta
                assert 0 <= peer < len(sims), f"stage {s} step {step}: {cmd!r} has no peer stage {peer}"
                other = cmds[peer][pcs[peer]] if pcs[peer] < len(cmds[peer]) else None
                if type(other) is not partner or cmd.name.startswith("Recv"):
                    continue  # the sender side completes the pair
                sims[peer].receive(other, sim.send(cmd))
                pcs[peer] += 1
            elif isinstance(cmd, LoadMicroBatch):
                sim.load(cmd)
            elif isinstance(cmd, ForwardPass):
                sim.forward(cmd, step)
            elif isinstance(cmd, BackwardPass):
                sim.backward(cmd, step)
            pcs[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: repr(cmds[s][pc]) for s, pc in enumerate(pcs) if pc < len(cmds[s])}
            raise Deadlock(f"deadlock at step {step}: {stuck}")


def simulate(cls: type[PipeSchedule], micro_batches: int, stages: int) -> tuple[list[_StageSim], int]:
    """Step all stages together, a barrier between steps; return the stage simulations and the step count."""
    sims = [_StageSim(cls(micro_batches, stages, s)) for s in range(stages)]
    per_stage = [list(sim.s) for sim in sims]
    total = len(per_stage[0])
    assert all(len(steps) == total for steps in per_stage)
    for step in range(total):
        _run_step(sims, [steps[step] for steps in per_stage], step)
    for sim in sims:  # everything consumed: no stray activation or gradient left in a buffer
        assert not (sim.inputs or sim.outputs or sim.out_grads or sim.in_grads or sim.labels)
    return sims, total


def _steps(cls, m, p):
    return [list(cls(m, p, s)) for s in range(p)]


# ---------------------------------------------------------------- train schedule properties


@settings(max_examples=60, deadline=None)
@given(MICRO_BATCHES, STAGES)
def test_one_forward_and_one_backward_per_micro_batch_in_closed_form(m, p):
    """Each stage runs micro-batches 0..m-1 forward and backward once, at the reference 1F1B steps."""
    for s, steps in enumerate(_steps(TrainSchedule, m, p)):
        assert len(steps) == 2 * (m + p - 1)
        buffers = TrainSchedule(m, p, s)
        fwd = {step: c.buffer_id for step, cmds in enumerate(steps) for c in cmds if isinstance(c, ForwardPass)}
        bwd = {step: c.buffer_id for step, cmds in enumerate(steps) for c in cmds if isinstance(c, BackwardPass)}
        assert fwd == {2 * i + s: buffers._buffer_idx(i) for i in range(m)}
        assert bwd == {2 * i + 2 * p - 1 - s: buffers._buffer_idx(i) for i in range(m)}
        assert all(2 * i + s < 2 * i + 2 * p - 1 - s for i in range(m))  # forward precedes its backward


@settings(max_examples=60, deadline=None)
@given(MICRO_BATCHES, STAGES)
def test_sends_pair_with_receives_in_the_same_step(m, p):
    for cls in (TrainSchedule, InferenceSchedule):
        steps = _steps(cls, m, p)
        for t in range(len(steps[0])):
            for s in range(p):
                count = {kind: sum(isinstance(c, kind) for c in steps[s][t]) for kind in PEER}
                assert count[SendActivation] <= 1 and count[SendGrad] <= 1
                if s + 1 < p:
                    assert count[SendActivation] == sum(isinstance(c, RecvActivation) for c in steps[s + 1][t])
                    assert count[RecvGrad] == sum(isinstance(c, SendGrad) for c in steps[s + 1][t])
                else:
                    assert count[SendActivation] == count[RecvGrad] == 0
                if s == 0:
                    assert count[RecvActivation] == count[SendGrad] == 0


@settings(max_examples=60, deadline=None)
@given(MICRO_BATCHES, STAGES)
def test_optimizer_step_comes_last_once(m, p):
    for s, steps in enumerate(_steps(TrainSchedule, m, p)):
        flat = [c for cmds in steps for c in cmds]
        assert steps[-1][-3:] == [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        for kind in (ReduceTiedGrads, ReduceGrads, OptimizerStep):
            assert sum(isinstance(c, kind) for c in flat) == 1
        loads = sum(isinstance(c, LoadMicroBatch) for c in flat)
        assert loads == (m if s in (0, p - 1) else 0)
    for steps in _steps(InferenceSchedule, m, p):
        flat = [c for cmds in steps for c in cmds]
        assert not any(isinstance(c, (BackwardPass, OptimizerStep, ReduceGrads, SendGrad, RecvGrad)) for c in flat)


@settings(max_examples=60, deadline=None)
@given(MICRO_BATCHES, STAGES)
def test_buffer_ids_stay_below_num_pipe_buffers(m, p):
    for cls in (TrainSchedule, InferenceSchedule):
        for s in range(p):
            schedule = cls(m, p, s)
            ids = {c.buffer_id for cmds in schedule for c in cmds if isinstance(c, BufferOpInstruction)}
            assert ids and all(0 <= b < schedule.num_pipe_buffers() for b in ids)
    assert all(TrainSchedule(m, p, s).num_pipe_buffers() == max(2, min(p - s, m)) for s in range(p))


# ---------------------------------------------------------------- all stages together


@settings(max_examples=60, deadline=None)
@given(MICRO_BATCHES, STAGES)
def test_train_simulation_no_deadlock_in_order_and_bubble(m, p):
    sims, total = simulate(TrainSchedule, m, p)
    assert total == 2 * (m + p - 1)
    for s, sim in enumerate(sims):
        forwards = [mb for kind, mb, _ in sim.log if kind == "forward"]
        backwards = [mb for kind, mb, _ in sim.log if kind == "backward"]
        assert forwards == backwards == list(range(m))  # one each, in micro-batch order
        forward_step: dict[int, int] = {}
        for kind, mb, step in sim.log:
            if kind == "forward":
                forward_step[mb] = step
            else:  # a backward only after its forward
                assert mb in forward_step and forward_step[mb] < step
        busy = len(sim.log)
        assert Fraction(total - busy, total) == Fraction(p - 1, m + p - 1)  # the 1F1B bubble, on every stage
        assert sim.peak_in_flight <= min(p - s, m)  # 1F1B: at most p - s micro-batches of activations held


@settings(max_examples=60, deadline=None)
@given(MICRO_BATCHES, STAGES)
def test_inference_simulation_no_deadlock_in_order(m, p):
    sims, total = simulate(InferenceSchedule, m, p)
    assert total == m + p - 1
    for s, sim in enumerate(sims):
        assert sim.log == [("forward", i, i + s) for i in range(m)]
        assert sim.peak_in_flight <= 2


@pytest.mark.parametrize(("m", "p"), [(1, 1), (1, 8), (16, 1), (3, 5), (8, 4), (32, 8)])
def test_bubble_fraction_examples(m, p):
    sims, total = simulate(TrainSchedule, m, p)
    idle = sum(total - len(sim.log) for sim in sims)
    assert Fraction(idle, total * p) == Fraction(p - 1, m + p - 1)


def test_the_simulation_catches_a_deadlock():
    """A schedule whose neighbours both send first in one step is reported, not hung."""

    class Crossed(PipeSchedule):
        def steps(self):
            if self.is_first_stage:
                yield [SendActivation(0), RecvGrad(0)]
            else:
                yield [SendGrad(0), RecvActivation(0)]

        def num_pipe_buffers(self):
            return 1

    with pytest.raises(Deadlock, match="deadlock at step 0"):
        simulate(Crossed, 1, 2)


def test_the_simulation_catches_an_overwritten_buffer():
    """A 1F1B order with one buffer too few on the first stage reuses a live slot: the simulation says so."""

    class TooFewBuffers(TrainSchedule):
        def num_pipe_buffers(self):
            return super().num_pipe_buffers() - (1 if self.stage_id == 0 else 0)

    with pytest.raises(AssertionError, match="overwritten while live"):
        simulate(TooFewBuffers, 6, 4)

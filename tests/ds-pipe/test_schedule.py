"""Pipeline schedules against the spec's "Pipeline Parallelism" chapter (its DataParallelSchedule example runs
as printed), DeepSpeed's exact instruction order for small pipelines, the instruction classes, and bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from _spec_docs import require_spec
from hypothesis import given
from hypothesis import strategies as st

import ds_pipe
from ds_pipe import schedule as sched
from ds_pipe.schedule import (
    BackwardPass,
    BufferOpInstruction,
    DataParallelSchedule,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

INSTRUCTIONS = ["OptimizerStep", "ReduceGrads", "ReduceTiedGrads", "BufferOpInstruction", "LoadMicroBatch",
                "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad"]
BUFFER_OPS = INSTRUCTIONS[3:]


def _spec_example() -> str:
    """The code block of the spec's PipeSchedule docs: "Below is an example schedule ... gradient accumulation"."""
    text = (require_spec("api-reference.txt") / "api-reference.txt").read_text(encoding="utf-8")
    start = text.index("class `deepspeed.runtime.pipe.schedule.PipeSchedule`")
    match = re.search(r"```\n(class DataParallelSchedule\(PipeSchedule\):.*?)```", text[start:], re.S)
    assert match, "the spec's DataParallelSchedule example was not found"
    return match.group(1)


# ---------------------------------------------------------------- the spec's documented example


@pytest.mark.parametrize("micro_batches", [1, 2, 5])
def test_spec_data_parallel_example_runs_and_matches_ours(micro_batches):
    """The spec's example subclass, executed as printed against our base class and instructions, yields the
    same steps as our DataParallelSchedule."""
    namespace = {name: getattr(sched, name) for name in sched.__all__}
    exec(compile(_spec_example(), "api-reference.txt", "exec"), namespace)  # noqa: S102 - the spec's own code
    example = namespace["DataParallelSchedule"](micro_batches=micro_batches, stages=1, stage_id=0)
    ours = DataParallelSchedule(micro_batches=micro_batches, stages=1, stage_id=0)
    assert list(example) == list(ours)
    assert example.num_pipe_buffers() == ours.num_pipe_buffers() == 1
    assert [repr(step) for step in ours][-1] == (
        "[LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0), BackwardPass(buffer_id=0), ReduceGrads(), "
        "OptimizerStep()]")


def test_data_parallel_schedule_steps():
    steps = list(DataParallelSchedule(micro_batches=3, stages=1, stage_id=0))
    plain = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
    assert steps == [plain, plain, plain + [ReduceGrads(), OptimizerStep()]]


def test_documented_num_pipe_buffers():
    assert InferenceSchedule(micro_batches=7, stages=4, stage_id=1).num_pipe_buffers() == 2
    assert DataParallelSchedule(micro_batches=7, stages=1, stage_id=0).num_pipe_buffers() == 1
    # min(stages - stage_id, micro_batches), and DeepSpeed never allocates fewer than 2
    assert [TrainSchedule(8, 4, s).num_pipe_buffers() for s in range(4)] == [4, 3, 2, 2]
    assert [TrainSchedule(3, 6, s).num_pipe_buffers() for s in range(6)] == [3, 3, 3, 3, 2, 2]
    assert TrainSchedule(1, 1, 0).num_pipe_buffers() == 2


# ---------------------------------------------------------------- DeepSpeed's exact order (golden listings)

TRAIN_4x2 = {  # TrainSchedule(micro_batches=4, stages=2, stage_id), as DeepSpeed's engine executes it
    0: ["[LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0)]",
        "[SendActivation(buffer_id=0)]",
        "[LoadMicroBatch(buffer_id=1), ForwardPass(buffer_id=1)]",
        "[RecvGrad(buffer_id=0), SendActivation(buffer_id=1), BackwardPass(buffer_id=0)]",
        "[LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0)]",
        "[RecvGrad(buffer_id=1), SendActivation(buffer_id=0), BackwardPass(buffer_id=1)]",
        "[LoadMicroBatch(buffer_id=1), ForwardPass(buffer_id=1)]",
        "[RecvGrad(buffer_id=0), SendActivation(buffer_id=1), BackwardPass(buffer_id=0)]",
        "[]",
        "[RecvGrad(buffer_id=1), BackwardPass(buffer_id=1), ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]"],
    1: ["[]",
        "[RecvActivation(buffer_id=0), LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0)]",
        "[BackwardPass(buffer_id=0)]",
        "[SendGrad(buffer_id=0), RecvActivation(buffer_id=1), LoadMicroBatch(buffer_id=1), ForwardPass(buffer_id=1)]",
        "[BackwardPass(buffer_id=1)]",
        "[SendGrad(buffer_id=1), RecvActivation(buffer_id=0), LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0)]",
        "[BackwardPass(buffer_id=0)]",
        "[SendGrad(buffer_id=0), RecvActivation(buffer_id=1), LoadMicroBatch(buffer_id=1), ForwardPass(buffer_id=1)]",
        "[BackwardPass(buffer_id=1)]",
        "[SendGrad(buffer_id=1), ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]"],
}

INFERENCE_3x3 = {  # InferenceSchedule(micro_batches=3, stages=3, stage_id): even stages send first, odd receive first
    0: ["[LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0)]",
        "[LoadMicroBatch(buffer_id=1), SendActivation(buffer_id=0), ForwardPass(buffer_id=1)]",
        "[LoadMicroBatch(buffer_id=0), SendActivation(buffer_id=1), ForwardPass(buffer_id=0)]",
        "[SendActivation(buffer_id=0)]",
        "[]"],
    1: ["[]",
        "[RecvActivation(buffer_id=0), ForwardPass(buffer_id=0)]",
        "[RecvActivation(buffer_id=1), SendActivation(buffer_id=0), ForwardPass(buffer_id=1)]",
        "[RecvActivation(buffer_id=0), SendActivation(buffer_id=1), ForwardPass(buffer_id=0)]",
        "[SendActivation(buffer_id=0)]"],
    2: ["[]",
        "[]",
        "[LoadMicroBatch(buffer_id=0), RecvActivation(buffer_id=0), ForwardPass(buffer_id=0)]",
        "[LoadMicroBatch(buffer_id=1), RecvActivation(buffer_id=1), ForwardPass(buffer_id=1)]",
        "[LoadMicroBatch(buffer_id=0), RecvActivation(buffer_id=0), ForwardPass(buffer_id=0)]"],
}


@pytest.mark.parametrize("stage_id", [0, 1])
def test_train_schedule_matches_deepspeed_order(stage_id):
    assert [repr(step) for step in TrainSchedule(4, 2, stage_id)] == TRAIN_4x2[stage_id]


@pytest.mark.parametrize("stage_id", [0, 1, 2])
def test_inference_schedule_matches_deepspeed_order(stage_id):
    assert [repr(step) for step in InferenceSchedule(3, 3, stage_id)] == INFERENCE_3x3[stage_id]


def test_single_stage_train_is_gradient_accumulation():
    steps = list(TrainSchedule(micro_batches=2, stages=1, stage_id=0))
    assert steps == [[LoadMicroBatch(0), ForwardPass(0)], [BackwardPass(0)],
                     [LoadMicroBatch(1), ForwardPass(1)],
                     [BackwardPass(1), ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]]


def test_step_to_micro_batch_even_odd_mapping():
    """Forward of micro-batch i on stage s at step 2i+s, backward at 2i+2p-1-s (DeepSpeed's four parity cases)."""
    p = 4
    for s in range(p):
        schedule = TrainSchedule(micro_batches=5, stages=p, stage_id=s)
        for i in range(5):
            assert schedule._step_to_micro_batch(2 * i + s) == (i, True)
            assert schedule._step_to_micro_batch(2 * i + 2 * p - 1 - s) == (i, False)


# ---------------------------------------------------------------- the schedule object


def test_properties_and_helpers():
    schedule = TrainSchedule(micro_batches=6, stages=3, stage_id=1)
    assert (schedule.stage, schedule.num_stages, schedule.num_micro_batches) == (1, 3, 6)
    assert (schedule.micro_batches, schedule.stages, schedule.stage_id) == (6, 3, 1)
    assert (schedule.prev_stage, schedule.next_stage) == (0, 2)
    assert not schedule.is_first_stage and not schedule.is_last_stage
    assert TrainSchedule(6, 3, 0).is_first_stage and TrainSchedule(6, 3, 2).is_last_stage
    only = TrainSchedule(6, 1, 0)
    assert only.is_first_stage and only.is_last_stage
    assert [schedule._valid_micro_batch(i) for i in (-1, 0, 5, 6)] == [False, True, True, False]
    assert [schedule._valid_stage(i) for i in (-1, 0, 2, 3)] == [False, True, True, False]
    assert [schedule._buffer_idx(i) for i in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [TrainSchedule(6, 3, 0)._buffer_idx(i) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="micro_batch_id"):
        schedule._buffer_idx(6)
    assert repr(schedule) == "TrainSchedule(micro_batches=6, stages=3, stage_id=1)"


def test_iteration_restarts_and_steps_is_a_generator():
    schedule = TrainSchedule(micro_batches=3, stages=2, stage_id=0)
    first = list(schedule)
    assert list(schedule) == first == list(schedule.steps())
    it = iter(schedule)
    next(it)
    assert [next(it) for _ in range(2)] == first[1:3]
    assert list(iter(schedule)) == first  # a new iter() starts over


def test_base_default_buffers_and_abstract_steps():
    with pytest.raises(TypeError):
        PipeSchedule(2, 2, 0)  # abstract: steps() is required

    class Custom(PipeSchedule):
        def steps(self):
            yield [ForwardPass(buffer_id=self._buffer_idx(0))]

    custom = Custom(micro_batches=3, stages=2, stage_id=1)
    assert custom.num_pipe_buffers() == 3 and list(custom) == [[ForwardPass(0)]]


def test_package_and_module_surface():
    assert set(INSTRUCTIONS) <= set(sched.__all__)
    for name in ("PipeSchedule", "TrainSchedule", "InferenceSchedule", "DataParallelSchedule", "PipeInstruction"):
        assert getattr(ds_pipe, name) is getattr(sched, name)


# ---------------------------------------------------------------- instructions


@pytest.mark.parametrize("name", INSTRUCTIONS)
def test_instruction_name_kwargs_repr(name):
    cls = getattr(sched, name)
    assert issubclass(cls, PipeInstruction)
    if name in BUFFER_OPS:
        assert issubclass(cls, BufferOpInstruction)
        inst = cls(3, note="x")
        assert (inst.name, inst.kwargs, inst.buffer_id, inst.note) == (name, {"buffer_id": 3, "note": "x"}, 3, "x")
        assert repr(inst) == f"{name}(buffer_id=3, note='x')"
        assert repr(cls(buffer_id=0)) == f"{name}(buffer_id=0)"
        with pytest.raises(TypeError):
            cls()  # buffer_id is required
    else:
        inst = cls()
        assert (inst.name, inst.kwargs, repr(inst)) == (name, {}, f"{name}()")
        assert repr(cls(k=1)) == f"{name}(k=1)" and cls(k=1).k == 1


def test_instruction_equality_and_hash():
    assert ForwardPass(1) == ForwardPass(buffer_id=1)
    assert ForwardPass(1) != ForwardPass(0)
    assert ForwardPass(1) != BackwardPass(1)  # same kwargs, different instruction
    assert SendActivation(0) != RecvActivation(0) and SendGrad(0) != RecvGrad(0)
    assert OptimizerStep() == OptimizerStep() and ReduceGrads() != ReduceTiedGrads()
    assert ForwardPass(1) != "ForwardPass(buffer_id=1)"
    assert len({ForwardPass(1), ForwardPass(buffer_id=1), BackwardPass(1)}) == 2
    assert hash(PipeInstruction(payload=[1, 2])) == hash(PipeInstruction(payload=[3]))  # unhashable values are fine


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("cls", [TrainSchedule, InferenceSchedule, DataParallelSchedule])
@pytest.mark.parametrize(("args", "error", "names"), [
    ((0, 2, 0), ValueError, "micro_batches must be at least 1, got 0"),
    ((-3, 2, 0), ValueError, "micro_batches"),
    ((4, 0, 0), ValueError, "stages must be at least 1, got 0"),
    ((4, 2, 2), ValueError, r"stage_id must be in \[0, stages\) = \[0, 2\), got 2"),
    ((4, 2, -1), ValueError, "stage_id"),
    ((4.0, 2, 0), TypeError, "micro_batches must be an int, got float"),
    ((4, "2", 0), TypeError, "stages must be an int"),
    ((4, 2, True), TypeError, "stage_id must be an int, got bool"),
])
def test_bad_arguments_name_the_argument(cls, args, error, names):
    with pytest.raises(error, match=names):
        cls(*args)


@given(st.integers(-5, 20), st.integers(-5, 20), st.integers(-5, 20))
def test_any_int_arguments_build_or_name_the_culprit(micro_batches, stages, stage_id):
    try:
        schedule = TrainSchedule(micro_batches, stages, stage_id)
    except ValueError as exc:
        culprit = ("micro_batches" if micro_batches < 1 else "stages" if stages < 1 else "stage_id")
        assert str(exc).startswith(culprit)
    else:
        assert micro_batches >= 1 and 0 <= stage_id < stages
        assert len(list(schedule)) == 2 * (micro_batches + stages - 1)


# ---------------------------------------------------------------- the documented module path

_PROBE = r"""
import json, importlib
import deepspeed.runtime.pipe.schedule as schedule
import ds_pipe.schedule
out = {"same": schedule is ds_pipe.schedule,
       "train": repr(list(schedule.TrainSchedule(micro_batches=1, stages=1, stage_id=0)))}
try:
    importlib.import_module("deepspeed.runtime.pipe.engine")
    out["pipe"] = "imported"
except ModuleNotFoundError as exc:
    out["pipe"] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


def test_served_at_deepspeed_runtime_pipe_schedule(tmp_path):
    """``deepspeed.runtime.pipe.schedule`` is ds_pipe.schedule itself; ``deepspeed.runtime.pipe.engine`` imports."""
    proc = subprocess.run([sys.executable, "-I", "-c", _PROBE], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["same"] is True
    assert out["train"] == ("[[LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0)], [BackwardPass(buffer_id=0), "
                            "ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]]")
    assert out["pipe"] == "imported"

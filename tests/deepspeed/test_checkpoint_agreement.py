"""A checkpoint fault on one rank fails every rank at once, naming the rank, the file and the cause (2 gloo ranks).

Load: rank 0 damages one file of a saved tag (rank 1's ZeRO optimizer shard, ZeRO-3's per-rank model states, or
the shared model states), then both ranks load it. Expected: every rank raises the same ``CheckpointRankError``
within seconds (the sync timeout is the default 30 minutes, so a rank left waiting would show as a test
timeout), nothing was loaded on any rank, and once the file is repaired the same ranks load it.
Save: one rank's writes fail (ENOSPC, EACCES, EIO through the atomic writer's open); both ranks raise, ``latest``
does not move, no temporary is left, and the tag that was being overwritten still loads with its old content.
"""

from __future__ import annotations

import errno
import glob
import os
import time

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
Z3_MODEL = "zero_pp_rank_1_mp_rank_00_model_states.pt"
MODEL = "mp_rank_00_model_states.pt"


def _engine(stage: int, offload: bool = False):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_batch_size": 4, "steps_per_print": 1000, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_force_ds_cpu_optimizer": False}  # torch's AdamW steps the offloaded states too
    return deepspeed.initialize(model=model, config=config)[0]


def _train(engine, seed: int) -> None:
    torch.manual_seed(seed + dist.get_rank())
    loss = engine(torch.randn(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _snapshot(engine) -> list[torch.Tensor]:
    """What a load would change: ZeRO's fp32 partitions, or the weights without ZeRO."""
    groups = getattr(engine.optimizer, "groups", None)
    if groups is not None:
        return [group.master.detach().clone() for group in groups]
    return [p.detach().clone() for p in engine.module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _damage(path: str, fault: str) -> None:
    if fault == "garbage":
        with open(path, "wb") as handle:
            handle.write(b"xyz not a checkpoint " * 40)
    elif fault == "truncated":
        with open(path, "rb") as handle:
            data = handle.read()
        with open(path, "wb") as handle:
            handle.write(data[: len(data) // 2])
    else:
        obj = torch.load(path, weights_only=False)
        if fault == "missing_key":
            obj.pop("optimizer_state_dict" if "optim_states" in path else "module")
        else:  # wrong_shape: the first fp32 partition, or the first weight of the module
            if "optim_states" in path:
                state = obj["optimizer_state_dict"]
                key = "fp32_flat_groups" if "fp32_flat_groups" in state else "single_partition_of_fp32_groups"
                state[key][0] = torch.zeros(3)
            else:
                obj["module"]["0.weight"] = torch.zeros(3, 3)
        torch.save(obj, path)


def _load_damaged(save_dir: str, stage: int, name: str, fault: str, offload: bool) -> dict:
    from deepspeed.runtime.checkpointing import CheckpointRankError

    engine = _engine(stage, offload)
    _train(engine, 1)
    engine.save_checkpoint(save_dir, tag="t")
    _train(engine, 2)
    before = _snapshot(engine)
    path = os.path.join(save_dir, "t", name)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(path, "rb") as handle:
            original = handle.read()
        _damage(path, fault)
    dist.barrier()
    start = time.monotonic()
    try:
        engine.load_checkpoint(save_dir)
        error: Exception | None = None
    except CheckpointRankError as exc:
        error = exc
    seconds = time.monotonic() - start
    unchanged = _same(before, _snapshot(engine))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(path, "wb") as handle:
            handle.write(original)
    dist.barrier()
    reloaded, _ = engine.load_checkpoint(save_dir)  # the ranks' meetings stay in step after a failure
    return {"error": None if error is None else str(error), "failures": None if error is None else
            {rank: tuple(f) for rank, f in error.failures.items()}, "seconds": seconds, "unchanged": unchanged,
            "reloaded": reloaded is not None}


# (stage, damaged file, fault, the ranks that fail, words of the cause)
LOAD_CASES = [
    (3, OPTIM, "garbage", [1], "not a checkpoint file"),
    (3, Z3_MODEL, "truncated", [1], "truncated"),
    (3, OPTIM, "missing_key", [1], "missing key 'optimizer_state_dict'"),
    (3, OPTIM, "wrong_shape", [1], "wrong shape: group 0's fp32_flat_groups has 3 elements"),
    (2, OPTIM, "garbage", [1], "not a checkpoint file"),
    (2, OPTIM, "missing_key", [1], "missing key 'optimizer_state_dict'"),
    (2, OPTIM, "wrong_shape", [1], "wrong shape: group 0's single_partition_of_fp32_groups has 3 elements"),
    (1, OPTIM, "truncated", [1], "truncated"),
    (0, MODEL, "truncated", [0, 1], "truncated"),
    (0, MODEL, "missing_key", [0, 1], "missing keys ['module']"),
    (0, MODEL, "wrong_shape", [0, 1], "0.weight has shape (3, 3) in the file and (16, 8) in the model"),
]


@pytest.mark.parametrize(("stage", "name", "fault", "ranks", "cause"), LOAD_CASES,
                         ids=[f"stage{c[0]}-{c[2]}-{c[1].split('_')[0]}" for c in LOAD_CASES])
def test_damaged_file_fails_every_rank_naming_rank_file_and_cause(tmp_path, stage, name, fault, ranks, cause):
    results = run_distributed(_load_damaged, world_size=2, args=(str(tmp_path), stage, name, fault, False),
                              timeout=90)
    heads = set()
    for rank, got in enumerate(results):
        message = got["error"]
        assert message is not None, f"rank {rank} loaded a damaged checkpoint"
        assert f"load_checkpoint failed on ranks {ranks} while reading" in message
        assert message.endswith(f"(raised on every rank; this is rank {rank})")
        for failing in ranks:
            file, reason = got["failures"][failing]
            assert os.path.basename(file) == name and cause in reason
            assert f"rank {failing}: {file}: " in message
        assert "weights_only" not in message and "Nothing was loaded on any rank" in message
        assert got["seconds"] < 10, f"rank {rank} took {got['seconds']:.1f} s to fail"
        assert got["unchanged"] and got["reloaded"]
        heads.add(message.rsplit(" (raised on every rank", 1)[0])
    assert len(heads) == 1  # the same message on every rank


def test_zero3_offload_garbage_optimizer_file(tmp_path):
    results = run_distributed(_load_damaged, world_size=2, args=(str(tmp_path), 3, OPTIM, "garbage", True),
                              timeout=90)
    for got in results:
        assert "failed on ranks [1] while reading" in got["error"] and OPTIM in got["error"]
        assert got["seconds"] < 10 and got["unchanged"] and got["reloaded"]


class _FailingWrites:
    """Replaces the atomic writer's ``open`` on one rank: fail at open (EACCES), at write (ENOSPC), or at flush
    (EIO), as a full disk, a read-only folder or a dying device would."""

    def __init__(self, real, code: int) -> None:
        self.real, self.code = real, code

    def __call__(self, path: str):
        if self.code == errno.EACCES:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        handle = self.real(path)
        code = self.code

        class Handle:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                handle.close()

            def write(self, data):
                if code == errno.ENOSPC:
                    raise OSError(code, os.strerror(code))
                return handle.write(data)

            def flush(self):
                raise OSError(code, os.strerror(code))

            def fileno(self):
                return handle.fileno()

        return Handle()


def _save_failing(save_dir: str, stage: int, code: int, failing_rank: int) -> dict:
    from deepspeed.runtime.checkpointing import CheckpointRankError
    from deepspeed.runtime.checkpointing import atomic as _atomic

    engine = _engine(stage)
    _train(engine, 1)
    engine.save_checkpoint(save_dir, tag="good")
    saved = _snapshot(engine)
    _train(engine, 2)
    real = _atomic._open_for_write
    if dist.get_rank() == failing_rank:
        _atomic._open_for_write = _FailingWrites(real, code)
    start = time.monotonic()
    try:
        engine.save_checkpoint(save_dir, tag="good")  # over the complete checkpoint 'latest' names
        error = None
    except CheckpointRankError as exc:
        error = str(exc)
    finally:
        _atomic._open_for_write = real
    seconds = time.monotonic() - start
    dist.barrier()
    temporaries = glob.glob(os.path.join(save_dir, "**", ".*.tmp-*"), recursive=True)
    with open(os.path.join(save_dir, "latest")) as handle:
        latest = handle.read()
    path, _ = engine.load_checkpoint(save_dir)
    result = {"error": error, "seconds": seconds, "temporaries": temporaries, "latest": latest,
              "loaded": path is not None, "old_content": _same(saved, _snapshot(engine))}
    if dist.get_rank() == failing_rank:  # a new tag: its folder does not stay behind, empty
        _atomic._open_for_write = _FailingWrites(real, code)
    try:
        engine.save_checkpoint(save_dir, tag="new")
    except CheckpointRankError:
        pass
    finally:
        _atomic._open_for_write = real
    dist.barrier()
    result["new_folder"] = os.path.exists(os.path.join(save_dir, "new"))
    return result


SAVE_CASES = [(3, errno.ENOSPC, 1), (3, errno.EIO, 1), (2, errno.EACCES, 1), (1, errno.EIO, 1), (0, errno.ENOSPC, 0)]


@pytest.mark.parametrize(("stage", "code", "failing"), SAVE_CASES,
                         ids=[f"stage{s}-{errno.errorcode[c]}-rank{r}" for s, c, r in SAVE_CASES])
def test_write_failure_on_one_rank_fails_every_rank_and_keeps_the_old_checkpoint(tmp_path, stage, code, failing):
    results = run_distributed(_save_failing, world_size=2, args=(str(tmp_path), stage, code, failing), timeout=90)
    name = "mp_rank_00_model_states.pt" if stage == 0 else f"zero_pp_rank_{failing}_mp_rank_00_"
    for got in results:
        message = got["error"]
        assert message is not None and f"save_checkpoint failed on ranks [{failing}] while writing" in message
        assert f"rank {failing}: {os.path.join(str(tmp_path), 'good', '')}" in message and name in message
        assert f"({errno.errorcode[code]})" in message and "Nothing was committed on any rank" in message
        assert got["seconds"] < 10
        assert got["temporaries"] == [] and got["latest"] == "good"
        assert got["loaded"] and got["old_content"]  # the overwritten tag still holds the old, complete save
        assert not got["new_folder"]


@pytest.mark.parametrize(("content", "reason"), [(b"\xff\xfe\x83", "not UTF-8 text"), (b"\n", "empty file"),
                                                 (b"../elsewhere", "not a tag file")])
def test_damaged_latest_is_named_not_decoded_or_followed(tmp_path, content, reason):
    from deepspeed.runtime.checkpointing import CorruptCheckpointError, read_latest

    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=reason) as err:
        read_latest(tmp_path)
    assert err.value.checkpoint_path == str(tmp_path / "latest")


def _pipeline_damaged_layer(save_dir: str) -> dict:
    from _pipe_models import gpt_batches, gpt_specs, lm_loss

    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.checkpointing import CheckpointRankError

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    module = PipelineModule(gpt_specs(), num_stages=2, loss_fn=lm_loss, seed_layers=True)
    engine, *_ = deepspeed.initialize(model=module, config=config)
    engine.train_batch(iter(gpt_batches(2)))
    engine.save_checkpoint(save_dir, tag="two")
    before = [p.detach().clone() for p in engine.module.parameters()]
    mine = [os.path.basename(engine.module.ckpt_layer_path("", i)) for i, f in enumerate(engine.module.forward_funcs)
            if isinstance(f, torch.nn.Module)]
    names: list = [None, None]
    dist.all_gather_object(names, mine)
    if dist.get_rank() == 0:  # a layer file only stage 1 (rank 1) reads
        _damage(os.path.join(save_dir, "two", names[1][0]), "garbage")
    dist.barrier()
    start = time.monotonic()
    try:
        engine.load_checkpoint(save_dir)
        error = None
    except CheckpointRankError as exc:
        error = str(exc)
    return {"error": error, "seconds": time.monotonic() - start, "file": names[1][0],
            "unchanged": _same(before, [p.detach() for p in engine.module.parameters()])}


def test_pipeline_stage_with_a_damaged_layer_file_fails_both_stages(tmp_path):
    results = run_distributed(_pipeline_damaged_layer, world_size=2, args=(str(tmp_path),), timeout=120)
    for got in results:
        assert got["error"] is not None and "failed on ranks [1] while reading" in got["error"]
        assert f"rank 1: {os.path.join(str(tmp_path), 'two', got['file'])}: not a checkpoint file" in got["error"]
        assert got["seconds"] < 10 and got["unchanged"]

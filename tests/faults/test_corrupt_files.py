"""A truncated or garbage file of each checkpoint file kind, loaded by a 2-rank ZeRO-1 job.

Kinds: the model states (read by every rank), rank 1's optimizer shard (read by rank 1 only), ``latest``, and a
parameter file of a universal checkpoint folder. For each: ``load_checkpoint`` raises on *both* ranks within
``LOAD_BOUND_S``, naming the file and the cause (and the rank whose file it is); nothing was loaded (every
parameter keeps its value, bitwise), and the checkpoint saved before (tag ``good``) still loads bitwise.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from _harness import run_distributed
from _sibling import load_sibling

_job = load_sibling(__file__, "_job.py", "_faults_job")
_record = load_sibling(__file__, "_record.py", "_faults_record")

LOAD_BOUND_S = 5.0  # the ranks agree through one store exchange right after reading; slack for a loaded machine
UNIVERSAL = dict(_job.CONFIG, checkpoint={"load_universal": True})


def _save_good_then_bad(work: str) -> None:
    engine = _job.build_engine()
    _job.train(engine, 2)
    engine.save_checkpoint(os.path.join(work, "ckpt"), tag="good")
    torch.save(engine.module.state_dict(), os.path.join(work, f"good_r{torch.distributed.get_rank()}.pt"))
    _job.train(engine, 1)
    engine.save_checkpoint(os.path.join(work, "ckpt"), tag="bad")  # 'latest' now names it


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """``ckpt/good``, ``ckpt/bad`` (in ``latest``), and ``ckpt/good_universal`` (in ``latest_universal``)."""
    from deepspeed.checkpoint import ds_to_universal

    work = tmp_path_factory.mktemp("saved")
    run_distributed(_save_good_then_bad, world_size=2, args=(str(work),), timeout=120)
    args = ds_to_universal.parse_arguments(["--input_folder", str(work / "ckpt" / "good"),
                                            "--output_folder", str(work / "ckpt" / "good_universal"),
                                            "--inject_missing_state"])
    assert ds_to_universal.main(args) == 0
    return work


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # garbage of the same length: a file whose every byte is wrong
        path.write_bytes(bytes((31 * i + 7) % 251 for i in range(max(len(data), 16))))


def _load_damaged(work: str, universal: bool) -> dict:
    engine = _job.build_engine(seed=7, config=UNIVERSAL if universal else None)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    started = time.monotonic()
    try:
        engine.load_checkpoint(os.path.join(work, "ckpt"))
        error = None
    except Exception as exc:  # noqa: BLE001 - the test asserts its type and message
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    untouched = all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
    untouched = untouched and engine.global_steps == 0
    engine = _job.build_engine(seed=7)
    engine.load_checkpoint(os.path.join(work, "ckpt"), tag="good")
    saved = torch.load(os.path.join(work, f"good_r{torch.distributed.get_rank()}.pt"), weights_only=True)
    good = all(torch.equal(v, saved[k]) for k, v in engine.module.state_dict().items())
    return {"error": error, "seconds": seconds, "untouched": untouched, "good_loads": good}


KINDS = {  # kind: (file under ckpt/, whose file, universal load)
    "model states file": ("bad/mp_rank_00_model_states.pt", None, False),
    "optimizer (ZeRO) shard of rank 1": ("bad/zero_pp_rank_1_mp_rank_00_optim_states.pt", 1, False),
    "`latest` file": ("latest", None, False),
    "parameter file of a universal checkpoint folder": ("good_universal/zero/0.weight/fp32.pt", None, True),
}


@pytest.mark.parametrize("how", ["truncated", "garbage"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_damaged_checkpoint_file(saved, tmp_path, kind, how):
    rel, owner, universal = KINDS[kind]
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "ckpt" / rel
    _damage(path, how)
    results = run_distributed(_load_damaged, world_size=2, args=(str(tmp_path), universal), timeout=120)
    for rank, r in enumerate(results):
        error = r["error"]
        assert error is not None, f"rank {rank} loaded a damaged {kind} without an error"
        assert r["seconds"] < LOAD_BOUND_S, (rank, r["seconds"])
        assert r["untouched"], f"rank {rank}: a failed load changed the engine's parameters or step"
        assert r["good_loads"], f"rank {rank}: the checkpoint saved before no longer loads bitwise"
        assert str(path) in error, error
        if owner is not None:
            assert f"rank {owner}: {path}" in error, error
    assert results[0]["error"] == results[1]["error"].replace("this is rank 1", "this is rank 0")
    _record.record(f"{how.capitalize()} {kind}", results[0]["error"], max(r["seconds"] for r in results),
                   f"< {LOAD_BOUND_S:g} s (raises on both ranks)",
                   "nothing loaded (parameters bitwise unchanged); tag `good` still loads bitwise")

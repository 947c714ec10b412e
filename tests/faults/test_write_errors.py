"""ENOSPC / EACCES on one rank while saving a checkpoint and while swapping optimizer state to NVMe, and a
truncated or garbage (same-size: caught by the swappers' checksums) NVMe swap file of one rank while training
(2 ranks; the write path patched on the victim, see ``_failing_io``).

Save: both ranks raise within ``SAVE_BOUND_S`` naming the rank, the file and the errno; ``latest`` still names
the checkpoint saved before, which loads bitwise; the next save (disk back) succeeds. Swap: the victim raises
naming the swap file and the errno; the other rank raises within the process-group timeout (or at once when the
victim's process is gone), naming rank 1 and what it raised; the checkpoint saved before loads bitwise.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import time
from datetime import timedelta

import pytest
import torch
from _harness import run_distributed
from _sibling import load_sibling

_job = load_sibling(__file__, "_job.py", "_faults_job")
_record = load_sibling(__file__, "_record.py", "_faults_record")
_io = load_sibling(__file__, "_failing_io.py", "_faults_failing_io")

SAVE_BOUND_S = 5.0  # the ranks agree after writing: one store exchange; slack for a loaded machine
PG_TIMEOUT_S = 9.0
# A stranded rank fails in its next collective: at once when the victim's process is gone, else when the
# process-group timeout runs out (the victim's process still holds its connections, as here).
SWAP_BOUND_S = PG_TIMEOUT_S + 10.0


def _save_with_failing_write(work: str, victim: int, match: str, err: int) -> dict:
    from deepspeed.runtime.checkpointing import read_latest

    ckpt = os.path.join(work, "ckpt")
    engine = _job.build_engine()
    _job.train(engine, 2)
    engine.save_checkpoint(ckpt, tag="good")
    rank = torch.distributed.get_rank()
    torch.save(engine.module.state_dict(), os.path.join(work, f"good_r{rank}.pt"))
    _job.train(engine, 1)
    failing = _io.failing_writes(ckpt, match, err) if rank == victim else contextlib.nullcontext([])
    started = time.monotonic()
    with failing as failed:
        try:
            engine.save_checkpoint(ckpt, tag="next")
            error = None
        except Exception as exc:  # noqa: BLE001 - the test asserts its type and message
            error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    latest = read_latest(ckpt)
    engine.save_checkpoint(ckpt, tag="retry")  # the disk is back: saving works again
    return {"error": error, "seconds": seconds, "latest": latest, "failed": failed,
            "retry_latest": read_latest(ckpt)}


def _load_good(work: str, config: dict | None = None) -> bool:
    engine = _job.build_engine(seed=7, config=config)
    engine.load_checkpoint(os.path.join(work, "ckpt"), tag="good")
    saved = torch.load(os.path.join(work, f"good_r{torch.distributed.get_rank()}.pt"), weights_only=True)
    return engine.global_steps == 2 and all(torch.equal(v, saved[k]) for k, v in engine.module.state_dict().items())


SAVE_CASES = {  # id: (victim, file name part, errno)
    "ENOSPC writing rank 1's optimizer shard": (1, "zero_pp_rank_1", errno.ENOSPC),
    "EACCES creating rank 1's optimizer shard": (1, "zero_pp_rank_1", errno.EACCES),
    "ENOSPC writing `latest` (rank 0)": (0, "latest", errno.ENOSPC),
}


@pytest.mark.parametrize("case", list(SAVE_CASES))
def test_write_error_during_save(tmp_path, case):
    victim, match, err = SAVE_CASES[case]
    results = run_distributed(_save_with_failing_write, world_size=2, args=(str(tmp_path), victim, match, err),
                              timeout=120)
    assert results[victim]["failed"], "the injected failure never hit a write"
    for rank, r in enumerate(results):
        error = r["error"]
        assert error is not None, f"rank {rank}: save_checkpoint returned although rank {victim} could not write"
        assert f"rank {victim}: " in error and errno.errorcode[err] in error and match in error, error
        assert r["seconds"] < SAVE_BOUND_S, (rank, r["seconds"])
        assert r["latest"] == "good", f"rank {rank}: a failed save moved 'latest' to {r['latest']!r}"
        assert r["retry_latest"] == "retry"
    assert run_distributed(_load_good, world_size=2, args=(str(tmp_path),), timeout=90) == [True, True]
    _record.record(f"{case} during save", results[0]["error"], max(r["seconds"] for r in results),
                   f"< {SAVE_BOUND_S:g} s (raises on both ranks)",
                   "`latest` unchanged; tag `good` loads bitwise; the next save succeeds")


def _nvme_config(work: str) -> dict:
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": os.path.join(work, "nvme")}}
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "zero_optimization": zero,
            "zero_force_ds_cpu_optimizer": False}


def _nvme_engine(work: str):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=_nvme_config(work))[0]


def _damage_swap(work: str, how: str) -> str:
    path = sorted(glob.glob(os.path.join(work, "nvme", "**", "rank1", "**", "0_master.tensor.swp"),
                        recursive=True))[0]
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        if how == "truncated":
            handle.truncate(size // 2)
        else:
            handle.write(bytes((31 * i + 7) % 251 for i in range(size)))
    return path


def _swap_fault(work: str, fault: str) -> dict:
    import deepspeed

    deepspeed.init_distributed(timeout=timedelta(seconds=PG_TIMEOUT_S))
    engine = _nvme_engine(work)
    _job.train(engine, 2)
    rank = torch.distributed.get_rank()
    engine.save_checkpoint(os.path.join(work, "ckpt"), tag="good")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        torch.save({k: v.clone() for k, v in engine.module.state_dict().items()},
                   os.path.join(work, f"good_r{rank}.pt"))
    damaged = _damage_swap(work, fault) if rank == 1 and fault in ("truncated", "garbage") else None
    err = {"ENOSPC": errno.ENOSPC, "EACCES": errno.EACCES}.get(fault)
    nvme = os.path.join(work, "nvme")
    failing = _io.failing_writes(nvme, ".swp", err) if rank == 1 and err else contextlib.nullcontext([])
    started, error = time.monotonic(), None
    with failing:
        try:
            _job.train(engine, 2)  # the victim fails in the first; the other rank at the latest in the second
        except Exception as exc:  # noqa: BLE001 - the test asserts its type and message
            error = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    if error is not None:  # as each process exiting would (the harness's closing barrier cannot pass any more)
        torch.distributed.destroy_process_group()
    return {"error": error, "seconds": seconds, "damaged": damaged}


@pytest.mark.parametrize("fault", ["ENOSPC", "EACCES", "truncated", "garbage"])
def test_nvme_swap_fault_while_training(tmp_path, fault):
    (tmp_path / "nvme").mkdir()
    results = run_distributed(_swap_fault, world_size=2, args=(str(tmp_path), fault), timeout=120,
                              init_process_group=False)
    victim, other = results[1], results[0]
    assert victim["error"] is not None, f"rank 1 trained on a {fault} swap file without an error"
    assert ".swp" in victim["error"], victim["error"]
    if fault in ("ENOSPC", "EACCES"):
        assert os.strerror(getattr(errno, fault)) in victim["error"], victim["error"]
    else:
        assert victim["damaged"] in victim["error"], victim["error"]
    if fault == "garbage":  # same size: only the checksum of what was written can tell
        assert "SwapCorruptionError" in victim["error"] and "rank 1: " in victim["error"], victim["error"]
        assert "CRC32" in victim["error"], victim["error"]
    assert other["error"] is not None, "rank 0 trained on although rank 1 failed"
    assert "rank 1 (pid" in other["error"] and ", and it raised in " in other["error"], other["error"]
    assert max(victim["seconds"], other["seconds"]) < SWAP_BOUND_S
    assert run_distributed(_load_good_nvme, world_size=2, args=(str(tmp_path),), timeout=120) == [True, True]
    what = {"ENOSPC": "ENOSPC opening an NVMe swap file for writing on rank 1",
            "EACCES": "EACCES opening an NVMe swap file for writing on rank 1",
            "truncated": "Truncated NVMe swap file of rank 1 while training",
            "garbage": "Garbage (same-size) NVMe swap file of rank 1 while training"}[fault]
    head, peers = other["error"].split(": a collective", 1)[0], other["error"].split("Peers: ", 1)[1]
    seen = f"rank 1: {victim['error']} | rank 0: {head}: ... Peers: {peers.split('. Transport error')[0]}"
    _record.record(what, seen,
                   max(victim["seconds"], other["seconds"]),
                   f"process-group timeout ({PG_TIMEOUT_S:g} s) + {SWAP_BOUND_S - PG_TIMEOUT_S:g} s",
                   "tag `good` (saved before) loads bitwise")


def _load_good_nvme(work: str) -> bool:
    import deepspeed

    engine = _nvme_engine(work)
    engine.load_checkpoint(os.path.join(work, "ckpt"), tag="good")
    saved = torch.load(os.path.join(work, f"good_r{torch.distributed.get_rank()}.pt"), weights_only=True)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        state = engine.module.state_dict()
        return engine.global_steps == 2 and all(torch.equal(v, saved[k]) for k, v in state.items())

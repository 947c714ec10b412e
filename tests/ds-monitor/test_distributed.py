"""Two real gloo ranks: with torch.distributed initialised, only global rank 0 writes."""

from __future__ import annotations

import os

from _harness import run_distributed

from ds_monitor import MonitorMaster


def _write_from_every_rank(root: str) -> tuple[int, int]:
    import torch.distributed as dist

    os.environ["RANK"] = "0"  # a stale launcher value: the initialised process group takes precedence
    master = MonitorMaster({"tensorboard": {"enabled": True, "output_path": root, "job_name": "job"},
                            "csv_monitor": {"enabled": True, "output_path": root, "job_name": "job"}})
    writing = len(master.monitors)
    master.write_events([("Train/Samples/train_loss", 1.0 + dist.get_rank(), 8)])
    master.close()
    dist.barrier()
    return master.rank, writing


def test_only_global_rank_zero_writes(tmp_path, read_tensorboard):
    assert run_distributed(_write_from_every_rank, world_size=2, args=(str(tmp_path),), timeout=60) == [(0, 2), (1, 0)]
    assert (tmp_path / "job" / "Train_Samples_train_loss.csv").read_text() == "step,train_loss\n8,1.0\n"
    assert read_tensorboard(tmp_path / "job") == {"Train/Samples/train_loss": [(8, 1.0)]}
    assert len(list((tmp_path / "job").glob("events.out.tfevents.*"))) == 1

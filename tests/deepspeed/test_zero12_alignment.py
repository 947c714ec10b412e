"""ZeRO 1/2's 16-bit alignment, at DeepSpeed's names: ``nccl_start_alignment_factor`` (2 elements),
``zero_optimization.allgather_bucket_size`` must be a multiple of it (an error naming the key, caught as
DeepSpeed's ``AssertionError`` too), and ``parallel_partitioned_bit16_groups`` lists every rank's partition of
the flat weights, each a view starting on a 4-byte boundary, together covering the whole flat buffer."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed


def _config(stage: int, bucket: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "allgather_bucket_size": bucket},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}


def _odd_bucket_body(stage: int) -> dict:
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import AllgatherBucketSizeError

    model = torch.nn.Linear(3, 5)
    try:
        deepspeed.initialize(model=model, config=_config(stage, 1001), model_parameters=model.parameters())
    except AssertionError as e:
        return {"raised": True, "typed": isinstance(e, AllgatherBucketSizeError) and isinstance(e, ValueError),
                "message": str(e)}
    return {"raised": False}


@pytest.mark.parametrize("stage", [1, 2])
def test_odd_allgather_bucket_size_is_refused_naming_the_key(stage):
    (r,) = run_distributed(_odd_bucket_body, world_size=1, args=(stage,), timeout=120)
    assert r["raised"] and r["typed"]
    assert "zero_optimization.allgather_bucket_size" in r["message"] and "1001" in r["message"]
    assert "must be a multiple of nccl_start_alignment_factor" in r["message"]


def _partitions_body() -> dict:
    import deepspeed

    torch.manual_seed(0)
    # 3*5 + 5 + 5*1 + 1 = 26 elements: the flat buffer pads to a multiple of 2 * world_size
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(2, 1000), model_parameters=model.parameters())
    opt = engine.optimizer
    factor = opt.nccl_start_alignment_factor
    out = {"factor": factor, "groups": []}
    for flat, parts in zip(opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups, strict=True):
        out["groups"].append({
            "ranks": len(parts),
            "aligned": all(p.data_ptr() % (2 * factor) == 0 for p in parts),
            "views": all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in parts),
            "covers": torch.equal(torch.cat(parts), flat),
            "equal_sizes": len({p.numel() for p in parts}) == 1 and parts[0].numel() % factor == 0,
        })
    return out


def test_parallel_partitions_are_aligned_views_covering_the_flat_buffer():
    results = run_distributed(_partitions_body, world_size=2, timeout=120)
    for r in results:
        assert r["factor"] == 2
        assert r["groups"] and all(g == {"ranks": 2, "aligned": True, "views": True, "covers": True,
                                         "equal_sizes": True} for g in r["groups"])

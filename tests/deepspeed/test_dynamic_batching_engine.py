"""Dynamic batching through ``deepspeed.initialize(training_data=...)`` on 2 gloo ranks: the engine's training loader
packs by the DataAnalyzer's sequence lengths, the config's schedule is scaled by each step's batch size, training
steps run and a checkpoint restores the scaled schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

N, MAX_TOKENS, MICRO = 40, 12, 2


def seqlen_of(i: int) -> int:
    return (i * 7) % 11 + 1


class _Sequences(torch.utils.data.Dataset):
    """Sample ``i``: ``seqlen_of(i)`` tokens, each holding ``i``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((seqlen_of(i),), float(i))


def _pad(samples: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=-1.0)


def _lengths(batch: torch.Tensor) -> torch.Tensor:
    return (batch != -1).sum(1)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(1, 1)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        mask = (batch != -1).float()
        out = self.lin((batch / N).unsqueeze(-1)).squeeze(-1)
        return ((out - 1) ** 2 * mask).sum() / mask.sum()


def _config(metrics_path: str, method: str = "linear") -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                         "warmup_num_steps": 4, "warmup_type": "linear"}},
            "data_efficiency": {"enabled": True, "seed": 3, "data_sampling": {
                "enabled": True, "dynamic_batching": {"enabled": True, "metrics_path": metrics_path,
                                                      "max_tokens": MAX_TOKENS, "lr_scaling_method": method,
                                                      "sequence_picking_order": "random"}}}}


def _reference_unscaled_lrs(steps: int) -> list[float]:
    """The config's WarmupLR on its own: the unscaled LR of each step."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ref = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        ref.step()
    return out


def _train(metrics_path: str, ckpt: str, steps: int) -> dict:
    import deepspeed
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import VariableBatchSizeLR

    engine, _, loader, sched = deepspeed.initialize(model=_Model(), training_data=_Sequences(), collate_fn=_pad,
                                                    config=_config(metrics_path))
    assert isinstance(sched, VariableBatchSizeLR) and engine.lr_scheduler is sched
    before = engine.module.lin.weight.detach().clone()
    records, it = [], iter(loader)
    for _ in range(steps):
        batch = next(it)
        total = torch.tensor([batch.shape[0]])
        dist.all_reduce(total)
        records.append({"lr": engine.get_lr()[0], "samples": int(total), "rank_samples": batch.shape[0],
                        "tokens": int(_lengths(batch).sum()), "ids": batch[:, 0].long().tolist()})
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        records[-1]["loss"] = loss.item()
    engine.save_checkpoint(ckpt, tag="t")
    resumed, _, _, resumed_sched = deepspeed.initialize(model=_Model(), training_data=_Sequences(), collate_fn=_pad,
                                                        config=_config(metrics_path))
    resumed.load_checkpoint(ckpt, tag="t")
    return {"explicit": _explicit_call(metrics_path + "_fresh", [r["ids"] for r in records]), "records": records,
            "len": len(loader), "moved": not torch.equal(before, engine.module.lin.weight),
            "lr_after": engine.get_lr()[0], "resumed_lr": resumed.get_lr()[0],
            "batch_sizes": list(sched.batch_sizes), "resumed_last_epoch": resumed_sched.last_epoch}


def _explicit_call(fresh_metrics_path: str, engine_ids: list[list[int]]) -> bool:
    """DeepSpeed's own usage: no file yet, so the DataAnalyzer (on both ranks) measures the lengths with
    ``batch_seqlens_fn``; then ``engine.deepspeed_io(**kwargs)`` gives the same batches as the built-in loader."""
    import deepspeed
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    )

    engine, *_ = deepspeed.initialize(model=_Model(), config=_config(fresh_metrics_path))
    _, sched, kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        _Sequences(), engine, dataloader_collate_fn=_pad, batch_seqlens_fn=_lengths)
    engine.lr_scheduler = sched
    loader = engine.deepspeed_io(**kwargs)
    ids = [batch[:, 0].long().tolist() for batch, _ in zip(loader, engine_ids, strict=False)]
    return ids == engine_ids


def _analyze(metrics_path: str) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer

    DataAnalyzer(_Sequences(), batch_size=8, metric_names=["seqlen"], metric_functions=[_lengths],
                 metric_types=["single_value_per_sample"], metric_dtypes=[np.int64], save_path=metrics_path,
                 collate_fn=_pad).run_map_reduce()


def test_engine_trains_with_token_budget_batches_and_scaled_lr(tmp_path):
    metrics = str(tmp_path / "metrics")
    _analyze(metrics)
    steps = 5
    results = run_distributed(_train, world_size=2, args=(metrics, str(tmp_path / "ckpt"), steps), timeout=120)
    unscaled = _reference_unscaled_lrs(steps)
    r0, r1 = results
    assert r0["len"] == r1["len"] == len(r0["batch_sizes"])  # every rank runs the same number of steps
    for step, (a, b) in enumerate(zip(r0["records"], r1["records"], strict=True)):
        assert a["samples"] == r0["batch_sizes"][step]  # the planned batch, split over the ranks
        assert a["lr"] == b["lr"] == pytest.approx(unscaled[step] * a["samples"] / (MICRO * 2))  # linear scaling
        for rec in (a, b):
            assert rec["tokens"] <= MICRO * MAX_TOKENS and np.isfinite(rec["loss"])
            assert rec["tokens"] == sum(seqlen_of(i) for i in rec["ids"])  # lengths came from the analyzer file
        assert not set(a["ids"]) & set(b["ids"])
    seen = [i for r in (r0, r1) for rec in r["records"] for i in rec["ids"]]
    assert len(seen) == len(set(seen))
    assert len({rec["samples"] for rec in r0["records"]}) > 1  # the batch size really varies
    assert r0["explicit"] and r1["explicit"]
    assert r0["moved"] and r0["resumed_lr"] == pytest.approx(r0["lr_after"]) and r0["resumed_last_epoch"] == steps

"""Engine wiring: a real 2-rank gloo training run through ``deepspeed.initialize`` emits the documented monitor
events (spec, "Monitoring": ``Train/Samples/*``) every ``steps_per_print`` optimizer steps, with the global
sample count as the step, from global rank 0 only; every backend's output is read back from disk.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import shutil
from pathlib import Path

import pytest
from _harness import run_distributed

LOSS, LR, SCALE = "Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale"
TIMERS = tuple(f"Train/Samples/elapsed_time_ms_{p}" for p in
               ("forward", "backward", "backward_inner", "backward_allreduce", "step"))
MICRO, IN = 2, 4  # per-rank micro batch, input features
STEPS, PRINT = 4, 2  # optimizer steps, steps_per_print
WORLD = 2
SAMPLES_PER_STEP = MICRO * WORLD


def _config(monitors: dict, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": PRINT,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            # a warm-up that moves the LR every step, so a stale or wrong LR in the events shows
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                         "warmup_num_steps": 8, "warmup_type": "linear"}},
            **monitors, **extra}


def _train(config: dict, steps: int, sabotage: str | None = None) -> dict:
    """Train a tiny linear model; returns what each report window should have emitted (rank 0's view).

    ``sabotage``: a directory replaced by a plain file after the first report, so the next monitor write fails.
    """
    import torch
    import torch.distributed as dist

    import deepspeed

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ds_monitor").addHandler(handler)
    torch.manual_seed(0)
    rank = dist.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(IN, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    fp16, gas = engine.fp16_enabled(), engine.gradient_accumulation_steps()
    expected, window = [], []
    for step in range(1, steps + 1):
        for micro in range(gas):
            x = torch.randn(MICRO * WORLD, IN)[rank * MICRO:(rank + 1) * MICRO] + step + micro / gas
            loss = engine(x.half() if fp16 else x).float().pow(2).mean()
            engine.backward(loss)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            window.append(float(mean) / WORLD)  # the loss as passed to backward, averaged over the ranks
            engine.step()
        assert engine.global_steps == step
        if step % PRINT == 0:
            expected.append({"step": engine.global_samples, LOSS: sum(window) / len(window),
                             LR: engine.get_lr()[0], SCALE: engine.optimizer.loss_scale})
            window = []
        if sabotage is not None and step == PRINT and rank == 0:
            engine.monitor.flush()
            shutil.rmtree(sabotage)
            Path(sabotage).write_text("not a directory any more\n")
    engine.monitor.flush()  # the writes run on the monitors' background thread
    writing = len(engine.monitor.monitors)
    failures = sum(m.failures for m in engine.monitor.monitors)
    engine.destroy()
    if "wandb" in config and rank == 0:
        import wandb

        wandb.teardown()  # wandb reads its environment once per process; this worker may run another test
    logging.getLogger("ds_monitor").removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    return {"expected": expected, "writing": writing, "failures": failures, "warnings": warnings,
            "global_steps": engine.global_steps}


def _read_csv_dir(job: Path) -> dict[str, list[tuple[int, float]]]:
    """{event name: [(step, value), ...]} from the CSV monitor's files (file name -> event name by the spec's
    separators: ``Train_Samples_x.csv`` is ``Train/Samples/x``)."""
    events = {}
    for path in sorted(job.glob("*.csv")):
        with open(path, newline="") as f:
            header, *rows = list(csv.reader(f))
        assert header[0] == "step" and path.stem.endswith(header[1])
        name = "Train/Samples/" + path.stem.removeprefix("Train_Samples_")
        events[name] = [(int(s), float(v)) for s, v in rows]
    return events


def _check(events: dict[str, list[tuple[int, float]]], expected: list[dict], names: tuple[str, ...],
           gas: int = 1) -> None:
    """Each documented name exactly once per report, at the sample count, with the engine's values."""
    assert sorted(events) == sorted(names)
    steps = [e["step"] for e in expected]
    assert steps == [SAMPLES_PER_STEP * gas * PRINT * (i + 1) for i in range(STEPS // PRINT)]
    for name in names:
        assert [s for s, _ in events[name]] == steps, name
        if name in (LOSS, LR, SCALE):
            assert [v for _, v in events[name]] == [pytest.approx(e[name], rel=1e-5) for e in expected], name


def test_all_four_monitors_get_the_documented_events_once_from_rank_zero(
        tmp_path, wandb_offline, comet_offline, read_wandb, read_comet, read_tensorboard):
    monitors = {"tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "job"},
                "wandb": {"enabled": True, "project": "engine-events"},
                "comet": {"enabled": True, "online": False, "samples_log_interval": 1, "project": "engine-events"},
                "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}}
    rank0, rank1 = run_distributed(_train, world_size=WORLD, args=(_config(monitors), STEPS), timeout=90)
    assert (rank0["writing"], rank1["writing"]) == (4, 0)
    expected, names = rank0["expected"], (LOSS, LR)
    assert rank0["warnings"] == [] and rank0["failures"] == 0
    # the LR moved between the reports, and so did the loss: the comparison below tells the windows apart
    assert expected[0][LR] != expected[1][LR] and expected[0][LOSS] != expected[1][LOSS]

    _check(_read_csv_dir(tmp_path / "csv" / "job"), expected, names)
    assert [p.name for p in (tmp_path / "csv").iterdir()] == ["job"]

    _check(read_tensorboard(tmp_path / "tb" / "job"), expected, names)
    assert len(list((tmp_path / "tb").rglob("events.out.tfevents.*"))) == 1  # no second writer (rank 1)

    _run, history = read_wandb(wandb_offline)  # asserts exactly one offline run: rank 1 started none
    _check({n: [(s, row[n]) for s, row in sorted(history.items()) if n in row]
            for n in {k for row in history.values() for k in row}}, expected, names)

    metrics, _texts = read_comet(comet_offline)  # asserts exactly one offline archive
    comet_events: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        comet_events.setdefault(m["metricName"], []).append((int(m["step"]), float(m["metricValue"])))
    _check(comet_events, expected, names)


def test_fp16_and_wall_clock_breakdown_add_loss_scale_and_timers(tmp_path):
    monitors = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    config = _config(monitors, wall_clock_breakdown=True,
                     fp16={"enabled": True, "initial_scale_power": 6, "loss_scale_window": 1})
    rank0, rank1 = run_distributed(_train, world_size=WORLD, args=(config, STEPS), timeout=60)
    assert (rank0["writing"], rank1["writing"]) == (1, 0)
    expected = rank0["expected"]
    assert expected[1][SCALE] > expected[0][SCALE] >= 2.0 ** 6  # the dynamic scale grew (window of 1 step)
    events = _read_csv_dir(tmp_path / "job")
    _check(events, expected, (LOSS, LR, SCALE, *TIMERS))
    for name in TIMERS:
        assert all(math.isfinite(v) and v >= 0.0 for _, v in events[name]), (name, events[name])
    for name in ("forward", "backward", "step"):  # measured phases took time (ms per optimizer step)
        assert all(v > 0.0 for _, v in events[f"Train/Samples/elapsed_time_ms_{name}"]), name


def test_flops_profiler_adds_timers_and_accumulation_steps_count_samples(tmp_path):
    monitors = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    config = _config(monitors, gradient_accumulation_steps=2,
                     flops_profiler={"enabled": True, "profile_step": 1, "detailed": False})
    rank0, _ = run_distributed(_train, world_size=WORLD, args=(config, STEPS), timeout=60)
    # one report per steps_per_print optimizer steps; the step is the sample count (micro x ranks x gas x steps)
    _check(_read_csv_dir(tmp_path / "job"), rank0["expected"], (LOSS, LR, *TIMERS), gas=2)


def test_without_fp16_or_breakdown_no_loss_scale_or_timer_events(tmp_path):
    monitors = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    run_distributed(_train, world_size=WORLD, args=(_config(monitors), PRINT), timeout=60)
    assert sorted(_read_csv_dir(tmp_path / "job")) == sorted([LOSS, LR])


def test_monitor_failing_mid_run_warns_once_and_training_continues(tmp_path):
    job = tmp_path / "job"
    monitors = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    rank0, rank1 = run_distributed(_train, world_size=WORLD, args=(_config(monitors), 3 * PRINT, str(job)),
                                   timeout=60)
    assert rank0["global_steps"] == rank1["global_steps"] == 3 * PRINT  # every step ran after the failure
    assert rank0["failures"] == 2  # the two reports after the sabotage
    assert len(rank0["warnings"]) == 1 and "csv_monitor monitor failed" in rank0["warnings"][0]
    assert rank1["warnings"] == [] and os.path.isfile(job)

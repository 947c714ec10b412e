"""The engine's periodic report, every ``steps_per_print`` optimizer steps: one log line on rank 0 (step,
skipped steps, lr, loss scale, ``loss(avg of last N steps)`` = the mean loss of the window's micro-steps over
the data-parallel ranks, samples/s; the phase timers with ``wall_clock_breakdown``, memory with
``memory_breakdown``) and the documented monitor events, with the global sample count as the event step.

Events (spec, "Monitoring"), written through the monitor master by global rank 0 only: ``Train/Samples/train_loss``
(mean loss of the window's micro-steps, averaged over the data-parallel ranks; omitted when no loss went through
``engine.backward``), ``Train/Samples/lr`` (first param group), ``Train/Samples/loss_scale`` (fp16 only) and, with
``wall_clock_breakdown`` or the flops profiler, ``Train/Samples/elapsed_time_ms_{forward, backward, backward_inner,
backward_allreduce, step}`` in milliseconds per optimizer step (mean over the window, measured on rank 0).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepspeed.utils import log_dist


def _mean_loss(engine: Any) -> float | None:
    """Mean training loss over the micro-steps since the last report, averaged over data-parallel ranks."""
    if engine._loss_sum is None or engine._losses_in_window == 0:
        return None
    value = engine._loss_sum / engine._losses_in_window
    if engine.dp_world_size > 1:
        value = value.to(engine.device).clone()
        dist.all_reduce(value, group=engine.dp_group)
        value = value / engine.dp_world_size
    return float(value)


def window_loss_label(steps: int) -> str:
    """The report's name for its loss figure: the mean over the ``steps`` optimizer steps since the last report."""
    return f"loss(avg of last {steps} step{'s' if steps != 1 else ''})"


def _events(engine: Any, loss: float | None, timer_ms: dict[str, float]) -> list[tuple[str, float, int]]:
    step = engine.global_samples
    events = []
    if loss is not None:
        events.append(("Train/Samples/train_loss", loss, step))
    events.append(("Train/Samples/lr", engine.get_lr()[0], step))
    if engine.fp16_enabled():
        events.append(("Train/Samples/loss_scale", engine.optimizer.loss_scale, step))
    events.extend((f"Train/Samples/elapsed_time_ms_{name}", ms, step) for name, ms in timer_ms.items())
    return events


def report_progress(engine: Any) -> None:
    """Log and emit the report for the window that ends at this optimizer step, then start a new window."""
    loss = _mean_loss(engine)
    steps = max(engine._steps_in_window, 1)
    timer_ms = {name: ms / steps for name, ms in engine.timers.elapsed_ms.items()} if engine.timers.enabled else {}
    rate = engine.tput.report()
    lrs = [f"{lr:.6g}" for lr in engine.get_lr()]
    loss_text = "n/a" if loss is None else f"{loss:.6g}"
    # The window mean, labelled as such: a training script's own "loss" is usually the last step's.
    log_dist(f"step={engine.global_steps}, skipped={engine.skipped_steps}, lr=[{', '.join(lrs)}], "
             f"loss_scale={engine.optimizer.loss_scale:g}, {window_loss_label(steps)}={loss_text}, "
             f"samples/sec={rate:.2f}", ranks=[0])
    if engine._config.memory_breakdown:
        from deepspeed.accelerator import get_accelerator

        accelerator, mib = get_accelerator(), 2.0 ** 20
        log_dist(f"memory (MiB) | allocated: {accelerator.memory_allocated() / mib:.1f} | max allocated: "
                 f"{accelerator.max_memory_allocated() / mib:.1f}", ranks=[0])
    if timer_ms:
        log_dist("time (ms) | " + " | ".join(f"{k}: {v:.2f}" for k, v in timer_ms.items()), ranks=[0])
    if engine.monitor is not None and engine.global_rank == 0:
        engine.monitor.write_events(_events(engine, loss, timer_ms))
    engine._loss_sum, engine._losses_in_window, engine._steps_in_window = None, 0, 0
    engine.timers.reset()


def build_monitor(config: Any) -> Any:
    """A ``ds_monitor.MonitorMaster`` when any monitor is enabled, else None."""
    if not any(getattr(config, s).enabled for s in ("tensorboard", "wandb", "comet", "csv_monitor")):
        return None
    from ds_monitor import MonitorMaster

    return MonitorMaster(config)


def build_flops_profiler(module: torch.nn.Module, config: Any, engine: Any) -> Any:
    """A ``ds_profiler.FlopsProfiler`` on ``module`` when ``flops_profiler.enabled``, else None."""
    if not config.flops_profiler.enabled:
        return None
    from ds_profiler import FlopsProfiler

    return FlopsProfiler(module, ds_engine=engine, recompute_fwd_factor=config.flops_profiler.recompute_fwd_factor)

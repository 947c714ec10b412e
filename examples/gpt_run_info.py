"""The opening lines of the GPT example (printed by rank 0 right after ``deepspeed.initialize``): what the engine
actually runs, read back from the engine rather than from the command line, so ``--zero_stage 3`` or a config edit
is visibly in effect.

Only documented engine methods are used (``zero_optimization_stage()``, ``fp16_enabled()``, ``bfloat16_enabled()``,
``zero_offload_optimizer()``, ``zero_offload_param()``, ``optimizer_name()``, ``scheduler_name()``, ...), so the
same lines come out under DeepSpeed itself.
"""

from __future__ import annotations

from typing import Any

_PARTITIONED = {
    0: "off: every rank holds the whole model, its gradients and optimizer states",
    1: "optimizer states partitioned",
    2: "optimizer states and gradients partitioned",
    3: "optimizer states, gradients and parameters partitioned",
}


def _precision(engine: Any) -> str:
    if engine.fp16_enabled():
        return "fp16 mixed precision (fp32 master weights, loss scaling)"
    if engine.bfloat16_enabled():
        return "bf16 mixed precision (fp32 master weights)"
    autocast = getattr(engine, "torch_autocast_enabled", None)
    if autocast is not None and autocast():
        return "fp32 weights, torch.autocast in forward"
    return "fp32"


def _offload_target(block: Any) -> str:
    """``cpu``, ``nvme (<path>)`` or ``none`` for one ``offload_*`` block (None when the config has none)."""
    device = getattr(block, "device", None) if block is not None else None
    device = str(getattr(device, "value", device) or "none")
    if device == "nvme":
        return f"nvme ({block.nvme_path})"
    return device


def _optimizer(engine: Any) -> str:
    name = engine.optimizer_name() or "client optimizer"
    params = engine.optimizer_params() or {}
    lr = f", lr {params['lr']:g}" if isinstance(params.get("lr"), (int, float)) else ""
    runs_as = type(getattr(engine, "basic_optimizer", None) or engine.optimizer).__name__
    schedule = engine.scheduler_name()
    return f"{name}{lr} (runs as {runs_as})" + (f", lr schedule {schedule}" if schedule else "")


def run_rows(engine: Any, world_size: int, backend: str) -> dict[str, str]:
    """The opening rows: ZeRO stage, precision, world size and batch, optimizer, offload targets."""
    stage = engine.zero_optimization_stage()
    return {
        "zero": f"stage {stage} ({_PARTITIONED.get(stage, 'unknown stage')}"
                + (f" over {world_size} ranks)" if stage else ")"),
        "precision": _precision(engine),
        "world": f"{world_size} ranks ({backend} on {engine.device}), global batch {engine.train_batch_size()} = "
                 f"micro {engine.train_micro_batch_size_per_gpu()} x GAS {engine.gradient_accumulation_steps()} "
                 f"x {world_size} ranks",
        "optimizer": _optimizer(engine),
        "offload": f"optimizer states -> {_offload_target(engine.zero_offload_optimizer())}, "
                   f"parameters -> {_offload_target(engine.zero_offload_param())}",
    }


"""Loading an AutoTP training checkpoint at another tensor-parallel size.

AutoTP's model-states files hold the full (gathered) weights, one file per tensor-parallel rank
(``mp_rank_XX_model_states.pt``), and a checkpoint saved without TP holds them too. So the weights load at any
tensor-parallel size: a rank whose own file is absent (TP 1 -> 2) reads ``mp_rank_00``, and each rank cuts its
shard out (``complete_module_state`` of the AutoTP extension), as on a same-size load.

Optimizer states are not re-sharded on a plain load: the ZeRO flat partitions interleave parameters of both TP
layouts, and asking for them raises before anything is loaded (a partial, silently wrong optimizer state is the
failure to avoid). The way across with the optimizer is DeepSpeed's documented one, a Universal Checkpoint:
``ds_to_universal`` puts each parameter's fp32 value and moments back together from the TP shards (with the
layouts saved under ``autotp_layouts``; ZeRO stage 1/2) and ``checkpoint.load_universal`` cuts each rank's shard
at any TP size. ``load_optimizer_states=False`` (or ``load_module_only=True``) carries the weights alone.
"""

from __future__ import annotations

import os
from typing import Any

from deepspeed.runtime.checkpointing._state import EngineState
from deepspeed.runtime.checkpointing.errors import CheckpointError
from deepspeed.runtime.checkpointing.layout import model_states_name

AUTOTP_SIZE_KEY = "autotp_size"  # written into the model states by the AutoTP extension


def current_autotp_size(state: EngineState) -> int | None:
    """This engine's AutoTP size: its AutoTP extension's ``autotp_size``, 1 without model parallelism,
    None for another model-parallel layout (an ``mpu`` whose files hold per-rank shards)."""
    for shard in state.shards:
        size = getattr(shard, AUTOTP_SIZE_KEY, None)
        if size is not None:
            return int(size)
    return 1 if state.parallel.mp_world_size == 1 else None


def saved_autotp_size(checkpoint: dict[str, Any]) -> int | None:
    """The AutoTP size a model-states file was saved with (1 when saved without model parallelism), None for
    another model-parallel layout."""
    size = checkpoint.get(AUTOTP_SIZE_KEY)
    if size is not None:
        return int(size)
    return 1 if int(checkpoint.get("mp_world_size", 1) or 1) == 1 else None


def fallback_model_states_path(state: EngineState, tag_dir: str, own: str) -> str:
    """``own`` when it exists; for an AutoTP rank whose file a smaller TP size never wrote, ``mp_rank_00``'s
    (every AutoTP or TP-less file holds the full weights; :func:`check_tp_resize` checks that it is one)."""
    if os.path.isfile(own) or state.parallel.mp_rank == 0 or current_autotp_size(state) in (None, 1):
        return own
    first = os.path.join(tag_dir, model_states_name(0))
    return first if os.path.isfile(first) else own


def check_tp_resize(state: EngineState, checkpoint: dict[str, Any], path: str, load_optimizer_states: bool,
                    load_module_only: bool) -> None:
    """Raise, before any state is touched, when ``checkpoint`` cannot load at this engine's TP size: another
    model-parallel layout, or optimizer states asked for across AutoTP sizes. Same size, or AutoTP on neither
    side (pipeline, ``mpu`` layouts keep their own checks): nothing to check."""
    autotp_here = any(getattr(shard, AUTOTP_SIZE_KEY, None) is not None for shard in state.shards)
    if AUTOTP_SIZE_KEY not in checkpoint and not autotp_here:
        return
    current, saved = current_autotp_size(state), saved_autotp_size(checkpoint)
    saved_mp = int(checkpoint.get("mp_world_size", 1) or 1)
    if saved_mp == state.parallel.mp_world_size and saved == current:
        return
    if current is None or saved is None:
        raise CheckpointError(
            f"{path}: saved with model-parallel size {saved_mp} (AutoTP size {saved}), loading with "
            f"model-parallel size {state.parallel.mp_world_size} (AutoTP size {current}); only AutoTP checkpoints "
            "(tensor_parallel.autotp_size, full weights in every file) or checkpoints without model parallelism "
            "load at another tensor-parallel size; accepted: the saved model-parallel size")
    if load_module_only or not load_optimizer_states or state.optimizer is None:
        return
    if checkpoint.get("optimizer") is None and not state.optimizer_in_shards():
        return  # no optimizer state to carry over: the weights, schedule and counters load
    raise CheckpointError(
        f"{path}: saved with tensor_parallel.autotp_size={saved}, loading with autotp_size={current}; optimizer "
        "states are not re-sharded by a plain load across tensor-parallel sizes (nothing was loaded). To resume "
        "exactly at the new size, convert the tag folder with `ds_to_universal --input_folder <tag folder> "
        "--output_folder <new folder> --inject_missing_state` (ZeRO stage 1/2) and load it with "
        '"checkpoint": {"load_universal": true}. Also accepted: load_checkpoint(..., load_optimizer_states=False) '
        "or load_module_only=True to load the weights (and with the former the LR schedule and counters) at the "
        f"new size, or autotp_size={saved}")

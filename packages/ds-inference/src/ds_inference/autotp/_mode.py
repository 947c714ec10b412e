"""Process-wide AutoTP mode (DeepSpeed's ``set_autotp_mode``): inference (default) or training."""

from __future__ import annotations

_TRAINING = False


def set_autotp_mode(training: bool = False) -> None:
    """Select AutoTP training mode (``deepspeed.initialize`` then shards with the training rules)."""
    global _TRAINING
    if not isinstance(training, bool):
        raise TypeError(f"set_autotp_mode: training must be a bool, got {training!r}")
    _TRAINING = training


def is_autotp_training_mode() -> bool:
    return _TRAINING


def get_auto_tp_mode() -> str:
    """``"TRAINING"`` or ``"INFERENCE"``."""
    return "TRAINING" if _TRAINING else "INFERENCE"

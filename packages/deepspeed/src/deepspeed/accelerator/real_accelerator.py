"""Choosing the process's accelerator: ``DS_ACCELERATOR`` (``cpu`` | ``cuda``) or auto-detection."""

from __future__ import annotations

import os

import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

SUPPORTED_ACCELERATOR_LIST = ["cpu", "cuda"]
_ACCELERATORS: dict[str, type[DeepSpeedAccelerator]] = {"cpu": CPU_Accelerator, "cuda": CUDA_Accelerator}
_current: DeepSpeedAccelerator | None = None


def _detect() -> str:
    """The device type torch would use: its current accelerator if it is CUDA, else the host."""
    found = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if found is not None and found.type == "cuda":
        return "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _from_name(name: str, source: str) -> DeepSpeedAccelerator:
    if name not in _ACCELERATORS:
        raise ValueError(
            f"{source}={name!r} is not a supported accelerator; choose one of {SUPPORTED_ACCELERATOR_LIST}"
        )
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{source}='cuda' but torch reports no usable CUDA device (torch {torch.__version__})")
    return _ACCELERATORS[name]()


def get_accelerator() -> DeepSpeedAccelerator:
    """The process-wide accelerator, created on first use from ``DS_ACCELERATOR`` or what torch detects."""
    global _current
    if _current is None:
        override = os.environ.get("DS_ACCELERATOR")
        _current = _from_name(override.strip().lower(), "DS_ACCELERATOR") if override else _from_name(_detect(), "auto")
    return _current


def set_accelerator(accel_obj: DeepSpeedAccelerator | str) -> None:
    """Replace the process-wide accelerator (an instance, or a name from ``SUPPORTED_ACCELERATOR_LIST``)."""
    global _current
    if isinstance(accel_obj, str):
        accel_obj = _from_name(accel_obj, "set_accelerator")
    if not isinstance(accel_obj, DeepSpeedAccelerator):
        raise TypeError(f"set_accelerator: expected a DeepSpeedAccelerator or a name, got {type(accel_obj).__name__}")
    _current = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator().name in SUPPORTED_ACCELERATOR_LIST

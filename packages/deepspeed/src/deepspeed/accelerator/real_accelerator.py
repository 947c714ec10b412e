"""Choosing the process's accelerator: ``DS_ACCELERATOR`` (one of ``SUPPORTED_ACCELERATOR_LIST``) or
auto-detection (CUDA when usable, else the host; the other device families are chosen by name)."""

from __future__ import annotations

import os

import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from deepspeed.accelerator.hpu_accelerator import HPU_Accelerator
from deepspeed.accelerator.klxpu_accelerator import KLXPU_Accelerator
from deepspeed.accelerator.mlu_accelerator import MLU_Accelerator
from deepspeed.accelerator.mps_accelerator import MPS_Accelerator
from deepspeed.accelerator.npu_accelerator import NPU_Accelerator
from deepspeed.accelerator.sdaa_accelerator import SDAA_Accelerator
from deepspeed.accelerator.supa_accelerator import SUPA_Accelerator
from deepspeed.accelerator.xpu_accelerator import XPU_Accelerator

_ACCELERATORS: dict[str, type[DeepSpeedAccelerator]] = {
    "cpu": CPU_Accelerator, "cuda": CUDA_Accelerator, "xpu": XPU_Accelerator, "npu": NPU_Accelerator,
    "mps": MPS_Accelerator, "hpu": HPU_Accelerator, "mlu": MLU_Accelerator, "sdaa": SDAA_Accelerator,
    "supa": SUPA_Accelerator, "klxpu": KLXPU_Accelerator,
}
SUPPORTED_ACCELERATOR_LIST = list(_ACCELERATORS)
_current: DeepSpeedAccelerator | None = None


def _cuda_fallback_reason() -> str | None:
    """Why CUDA is passed over although torch names it its accelerator (a CUDA build on a host without a usable
    GPU); None when torch does not name CUDA or CUDA is usable."""
    found = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if found is None or found.type != "cuda" or torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "no NVIDIA driver or no visible GPU"
    return (f"torch {torch.__version__} is a CUDA {torch.version.cuda or '?'} build but torch.cuda.is_available() "
            f"is False ({hidden})")


def _detect() -> str:
    """The device type to use when ``DS_ACCELERATOR`` is unset: CUDA when torch can use it, else the host.

    A CUDA build of torch on a machine without a GPU still names CUDA its accelerator; like DeepSpeed, fall back
    to the CPU there, saying so once per node, instead of failing on the first CUDA call.
    """
    if torch.cuda.is_available():
        return "cuda"
    reason = _cuda_fallback_reason()
    if reason is not None and os.environ.get("LOCAL_RANK", "0") in ("0", "-1"):
        from deepspeed.utils.logging import logger

        logger.warning(f"accelerator: cpu (auto-detected) because {reason}; set DS_ACCELERATOR=cpu to choose it "
                       "explicitly, or DS_ACCELERATOR=cuda to require CUDA and fail without it")
    return "cpu"


def _from_name(name: str, source: str) -> DeepSpeedAccelerator:
    if name not in _ACCELERATORS:
        raise ValueError(
            f"{source}={name!r} is not a supported accelerator; choose one of {SUPPORTED_ACCELERATOR_LIST}"
        )
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{source}='cuda' but torch reports no usable CUDA device (torch {torch.__version__}, "
                         f"torch.cuda.is_available() is False); use {source}='cpu' to run on the host")
    accelerator = _ACCELERATORS[name]()
    if name not in ("cpu", "cuda") and not accelerator.is_available():
        plugin = getattr(accelerator, "_plugin", None)
        needs = f" (it needs the {plugin!r} package)" if plugin else ""
        raise ValueError(f"{source}={name!r} but no {name!r} device is usable here{needs}; use {source}='cpu' to run "
                         "on the host")
    return accelerator


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

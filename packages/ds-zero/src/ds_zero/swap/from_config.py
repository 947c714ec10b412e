"""The ``zero_optimization.offload_optimizer`` / ``offload_param`` sections with ``device: nvme`` (and ``aio``)
as swap settings, and putting a partitioned model's parameters on NVMe."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ds_zero.swap._folder import aio_settings
from ds_zero.swap.optimizer_swapper import OptimizerSwapSettings
from ds_zero.swap.param_swapper import ParamSwapper, ParamSwapSettings, is_swapped


def _get(section: Any, key: str, default: Any = None) -> Any:
    if isinstance(section, dict):
        return section.get(key, default)
    return getattr(section, key, default)


def on_nvme(section: Any) -> bool:
    """Whether an offload section (typed or dict) has ``device: nvme``."""
    device = _get(section, "device") if section is not None else None
    return str(getattr(device, "value", device) or "none").lower().endswith("nvme")


def _path(section: Any, key: str) -> str:
    path = _get(section, "nvme_path")
    if path is None or not str(path).strip():
        raise ValueError(f"zero_optimization.{key}.nvme_path: device 'nvme' needs the path of the NVMe mount (a "
                         "directory on a local disk), got nothing")
    return os.fspath(path)


def optimizer_swap_settings(section: Any, aio: Any) -> OptimizerSwapSettings | None:
    """``offload_optimizer`` on NVMe, or None."""
    if not on_nvme(section):
        return None
    aio_settings(aio)  # use_gds and bad values fail now, not at the first step
    return OptimizerSwapSettings(
        nvme_path=_path(section, "offload_optimizer"), buffer_count=int(_get(section, "buffer_count", 4)),
        pin_memory=bool(_get(section, "pin_memory", False)), pipeline_read=bool(_get(section, "pipeline_read", False)),
        pipeline_write=bool(_get(section, "pipeline_write", False)), fast_init=bool(_get(section, "fast_init", False)),
        ratio=float(_get(section, "ratio", 1.0)), aio=aio)


def param_swap_settings(section: Any, aio: Any) -> ParamSwapSettings | None:
    """``offload_param`` on NVMe, or None."""
    if not on_nvme(section):
        return None
    aio_settings(aio)
    return ParamSwapSettings(
        nvme_path=_path(section, "offload_param"), buffer_count=int(_get(section, "buffer_count", 5)),
        buffer_size=int(_get(section, "buffer_size", 100_000_000)),
        max_in_cpu=int(_get(section, "max_in_cpu", 1_000_000_000)),
        pin_memory=bool(_get(section, "pin_memory", False)), aio=aio)


def global_rank() -> int:
    """This process's rank in the world (names its swap folder, unique on a shared disk)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def swap_params(params: list[torch.nn.Parameter], settings: ParamSwapSettings | None,
                swapper: ParamSwapper | None = None) -> ParamSwapper | None:
    """Put the partitions of ``params`` (partitioned ZeRO-3 parameters) on NVMe, reusing the swapper that
    already holds some of them (built by ``zero.Init(remote_device="nvme")``); returns the swapper."""
    if settings is None and swapper is None:
        return None
    swapper = swapper or next((p.ds_swapper for p in params if is_swapped(p)), None)
    if swapper is None:
        swapper = ParamSwapper(settings, global_rank())
    for p in params:
        swapper.adopt(p)
    return swapper

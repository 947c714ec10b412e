"""ZeRO offload sub-sections: ``offload_param`` and ``offload_optimizer`` (CPU or NVMe), and the offload enums
(``deepspeed.runtime.zero.offload_config``)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import field_validator, model_validator

from ds_config._errors import ConfigError, ConfigProblem
from ds_config._typed_section import Bool, Fraction, NonNegInt, SectionModel


class OffloadDeviceEnum(str, Enum):
    """Where offloaded tensors live."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """Engine states ``engine.offload_states(include=...)`` can move off the accelerator."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class _OffloadTarget(SectionModel):
    """The keys every offload section starts with: where to, and the NVMe path when that is NVMe."""

    device: OffloadDeviceEnum = OffloadDeviceEnum.none
    """Device memory to offload to: 'cpu' or 'nvme' ('none' disables the offload)."""

    nvme_path: Path | None = None
    """Filesystem path of the NVMe device used for offloading."""

    @field_validator("nvme_path", mode="before")
    @classmethod
    def _blank_path_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadTarget:
        if self.device == OffloadDeviceEnum.nvme and self.nvme_path is None:
            raise ConfigError(ConfigProblem(
                "device", "'nvme' needs 'nvme_path' (the NVMe mount point, e.g. '/local_nvme')", "nvme"))
        return self

    @property
    def enabled(self) -> bool:
        """True when the tensors actually leave the accelerator."""
        return self.device != OffloadDeviceEnum.none


class DeepSpeedZeroOffloadParamConfig(_OffloadTarget):
    """Set options for parameter offload (``offload_param``). Valid only with stage 3."""

    buffer_count: NonNegInt = 5
    """Number of buffers in buffer pool for parameter offloading to NVMe."""

    buffer_size: NonNegInt = 100_000_000
    """Size of buffers in buffer pool for parameter offloading to NVMe (elements)."""

    max_in_cpu: NonNegInt = 1_000_000_000
    """Number of parameter elements to maintain in CPU memory when offloading to NVMe is enabled."""

    pin_memory: Bool = False
    """Offload to page-locked CPU memory (faster transfers, more pinned host memory)."""


class DeepSpeedZeroOffloadOptimizerConfig(_OffloadTarget):
    """Set options for optimizer offload (``offload_optimizer``). Valid with stage 1, 2 and 3; NVMe only with 3.

    The optimizer step runs on CPU whatever the device.
    """

    buffer_count: NonNegInt = 4
    """Number of buffers in buffer pool for optimizer state offloading to NVMe (at least the number of
    states per parameter; Adam keeps 4)."""

    pin_memory: Bool = False
    """Offload to page-locked CPU memory (faster transfers, more pinned host memory)."""

    pipeline_read: Bool = False
    """Tile-based optimizer step: overlap the read of the next tile with computation of the current one."""

    pipeline_write: Bool = False
    """Tile-based optimizer step: overlap the write of the previous tile with computation of the current one."""

    fast_init: Bool = False
    """Enable fast optimizer initialization when offloading to NVMe."""

    ratio: Fraction = 1.0
    """Fraction of optimizer states offloaded to CPU Adam. Only valid with ZeRO stage 3."""

    super_offload: Bool = False
    """High performance CPU offloading for Superchips. Only valid with ZeRO stage 3."""

    cpuadam_cores_perc: Fraction = 0.8
    """Fraction of CPU cores used by CPU Adam. Only valid with ZeRO stage 3 and ``super_offload``."""

    @property
    def pipeline(self) -> bool:
        """Tile-based pipelining of the NVMe optimizer swap is on: ``pipeline_read or pipeline_write`` (DeepSpeed's
        derived ``pipeline`` attribute; computed on read, so it follows assignments and stays out of dumps)."""
        return self.pipeline_read or self.pipeline_write

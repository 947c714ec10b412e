"""``elasticity`` section: elastic training that picks batch sizes valid over a range of GPU counts.

Served as ``deepspeed.elasticity.config``: the section model (also built DeepSpeed's way,
``ElasticityConfig(param_dict)``) and the elasticity errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from ds_config._base import DSConfigModel, validate_section
from ds_config._errors import ConfigError, ConfigProblem
from ds_config._types import Bool, NonNeg, PosInt
from ds_config.elastic_constants import MAX_ACCEPTABLE_BATCH_SIZE, MICRO_BATCHES


class ElasticityError(ConfigError):
    """Base exception for all elasticity related errors (a ``ConfigError`` on the ``elasticity`` section)."""

    def __init__(self, message: str | Sequence[ConfigProblem] = "", path: str = "elasticity") -> None:
        super().__init__(message, path)


class ElasticityConfigError(ElasticityError):
    """The elasticity config is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one the elastic config supports."""


class ElasticityConfig(DSConfigModel):
    """``elasticity``: all batch information comes from here when enabled.

    ``ElasticityConfig(param_dict)`` builds it DeepSpeed's way: with ``enabled`` true, ``max_train_batch_size``
    and ``micro_batch_sizes`` are required, and any problem raises ``ElasticityConfigError``.
    """

    enabled: Bool = False
    """Enable elastic training."""
    max_train_batch_size: PosInt = 2000
    """Largest acceptable global batch size."""
    micro_batch_sizes: list[PosInt] = Field(default_factory=lambda: [2, 4, 6], min_length=1)
    """Acceptable micro batch sizes (same meaning as ``train_micro_batch_size_per_gpu``)."""
    min_gpus: PosInt = 1
    """Fewest GPUs to consider (v0.1 and v0.2)."""
    max_gpus: PosInt = 10000
    """Most GPUs to consider (v0.1 and v0.2)."""
    min_time: NonNeg = 0
    """Minimum running time in minutes before the scheduler scales again (v0.1 only; 0 = unknown)."""
    prefer_larger_batch: Bool = Field(True, validation_alias=AliasChoices("prefer_larger_batch",
                                                                          "prefer_large_batch"))
    """Prefer the batch size closest to ``max_train_batch_size``."""
    version: Literal[0.1, 0.2] = 0.2
    """Version of the elastic logic."""
    ignore_non_elastic_batch_info: Bool = False
    """Ignore batch keys outside this section instead of rejecting them."""
    num_gpus_per_node: PosInt = 1
    """GPUs per node (v0.2, for model parallelism)."""
    model_parallel_size: PosInt = 1
    """Tensor/model-parallel size (v0.2)."""

    def __init__(self, param_dict: dict[str, Any] | None = None, /, **data: Any) -> None:
        if param_dict is None:
            super().__init__(**data)
            return
        if not isinstance(param_dict, dict):
            raise ElasticityConfigError(f"expected the elasticity config as a dict, got {type(param_dict).__name__}")
        if param_dict.get("enabled"):
            for key in (MAX_ACCEPTABLE_BATCH_SIZE, MICRO_BATCHES):
                if key not in param_dict:
                    raise ElasticityConfigError(f"Elasticity config missing {key}", f"elasticity.{key}")
        try:
            validate_section(ElasticityConfig, {**param_dict, **data}, path="elasticity")
        except ConfigError as exc:
            raise ElasticityConfigError(exc.problems) from None
        super().__init__(**param_dict, **data)

    # DeepSpeed's attribute names for the same values
    @property
    def max_acceptable_batch_size(self) -> int:
        return self.max_train_batch_size

    @property
    def micro_batches(self) -> list[int]:
        return list(self.micro_batch_sizes)

    @property
    def prefer_larger_batch_size(self) -> bool:
        return self.prefer_larger_batch

    @model_validator(mode="before")
    @classmethod
    def _version_number(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("version"), (int, float, str)) \
                and not isinstance(data.get("version"), bool):
            try:
                data = {**data, "version": round(float(data["version"]), 3)}
            except ValueError:
                pass
        return data

    @model_validator(mode="after")
    def _ranges(self) -> ElasticityConfig:
        if self.max_gpus < self.min_gpus:
            raise ValueError(f"max_gpus ({self.max_gpus}) must be >= min_gpus ({self.min_gpus})")
        if min(self.micro_batch_sizes) > self.max_train_batch_size:
            raise ValueError(f"every micro batch size {self.micro_batch_sizes} exceeds "
                             f"max_train_batch_size ({self.max_train_batch_size})")
        return self


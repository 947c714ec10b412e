"""Monitor sections: ``tensorboard``, ``wandb``, ``comet``, ``csv_monitor``.

Serves ``deepspeed.monitor.config``. The Comet API key is a ``SecretStr``: it never shows in ``repr()``,
``str()``, JSON dumps or config errors; the Comet monitor reads it with ``api_key.get_secret_value()``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from ds_config._typed_section import Bool, PosInt, SectionModel

__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig"]


class TensorBoardConfig(SectionModel):
    """Sets parameters for TensorBoard monitor."""

    enabled: Bool = False
    """Log to TensorBoard (needs the ``tensorboard`` package)."""

    output_path: str = ""
    """Directory for the event files; empty means under the launch directory."""

    job_name: str = "DeepSpeedJobName"
    """Name of the current job: a sub-directory of ``output_path``."""


class WandbConfig(SectionModel):
    """Sets parameters for WandB monitor."""

    enabled: Bool = False
    """Log to Weights & Biases (needs the ``wandb`` package)."""

    group: str | None = None
    """WandB group, to group runs together."""

    team: str | None = None
    """WandB team (entity)."""

    project: str = "deepspeed"
    """WandB project."""


class _Masked:
    """Stands in for a malformed api_key so that the validation error cannot echo it."""

    def __repr__(self) -> str:
        return "'**********'"


class CometConfig(SectionModel):
    """Sets parameters for Comet monitor (a ``comet_ml`` experiment)."""

    enabled: Bool = False
    """Log to Comet (needs the ``comet_ml`` package)."""

    samples_log_interval: PosInt = 100
    """Submit metrics every this many samples."""

    project: str | None = None
    """Comet project (else ``.comet.config`` / ``COMET_PROJECT_NAME``)."""

    workspace: str | None = None
    """Comet workspace (else ``.comet.config`` / ``COMET_WORKSPACE``)."""

    api_key: SecretStr | None = None
    """Comet API key (else ``.comet.config`` / ``COMET_API_KEY``); kept secret."""

    experiment_name: str | None = None
    """Name of the Comet experiment."""

    experiment_key: str | None = None
    """Key of the Comet experiment (Comet wants 32-50 alphanumeric characters; Comet checks it)."""

    online: Bool | None = None
    """Log to the Comet server (unset means True); False stores an offline experiment."""

    mode: Literal["get", "create", "get_or_create"] | None = None
    """'get' an existing experiment, 'create' a new one, or 'get_or_create' (Comet's default)."""

    @model_validator(mode="before")
    @classmethod
    def _mask_bad_key(cls, data: Any) -> Any:
        # a non-string key would fail validation, and errors echo the offending value
        if isinstance(data, dict) and not isinstance(data.get("api_key"), (str, SecretStr, type(None))):
            data = {**data, "api_key": _Masked()}
        return data


class CSVConfig(SectionModel):
    """Sets parameters for CSV monitor."""

    enabled: Bool = False
    """Log to local CSV files."""

    output_path: str = ""
    """Directory for the CSV files; empty means under the launch directory."""

    job_name: str = "DeepSpeedJobName"
    """Name of the current job: a sub-directory of ``output_path``."""


class DeepSpeedMonitorConfig(SectionModel):
    """The four monitor sections together, as the monitor master receives them."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)

    @property
    def enabled(self) -> bool:
        """True when any monitor is enabled."""
        return any(s.enabled for s in (self.tensorboard, self.comet, self.wandb, self.csv_monitor))

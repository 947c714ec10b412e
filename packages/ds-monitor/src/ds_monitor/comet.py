"""Comet monitor (``deepspeed.monitor.comet``): a ``comet_ml`` experiment, one point per metric per interval.

``comet_ml.start`` returns an online experiment, or an offline one (an archive in Comet's offline directory,
``COMET_OFFLINE_DIRECTORY``) when ``online`` is false; ``mode`` picks get / create / get_or_create. Uploads run
on comet_ml's own streaming thread. The API key is read from the config's ``SecretStr`` only when the
experiment starts and is masked in every message this monitor produces.
"""

from __future__ import annotations

import os
from typing import Any

from ds_config.monitor import CometConfig
from ds_monitor._base import Monitor
from ds_monitor._events import Event
from ds_monitor.utils import EventsLogScheduler, import_backend

__all__ = ["CometMonitor"]


class CometMonitor(Monitor):
    """Logs events as Comet metrics, each name at most once every ``samples_log_interval`` samples."""

    section = "comet"
    config_model = CometConfig

    def __init__(self, comet_config: Any, *, rank: int | None = None) -> None:  # DeepSpeed's name
        super().__init__(comet_config, rank=rank)

    experiment: Any = None
    """The ``comet_ml`` experiment (set on the writing rank)."""

    @property
    def samples_log_interval(self) -> int:
        """Minimum distance in samples between two points of one metric."""
        return self.monitor_config.samples_log_interval

    def _secrets(self) -> tuple[str, ...]:
        key = self.monitor_config.api_key
        # comet_ml also reads COMET_API_KEY; its errors may quote whichever key it used
        return tuple(s for s in (key.get_secret_value() if key else None, os.environ.get("COMET_API_KEY")) if s)

    def _open(self) -> None:
        comet_ml = import_backend(self.section)
        cfg = self.monitor_config
        self._scheduler = EventsLogScheduler(cfg.samples_log_interval)
        self.experiment = comet_ml.start(
            api_key=cfg.api_key.get_secret_value() if cfg.api_key else None,
            workspace=cfg.workspace,
            project=cfg.project,
            experiment_key=cfg.experiment_key,
            mode=cfg.mode,
            online=cfg.online,
        )
        if cfg.experiment_name is not None:
            self.experiment.set_name(cfg.experiment_name)

    def _write(self, events: list[Event]) -> None:
        for name, value, step in events:
            if self._scheduler.needs_logging(name, step):
                self.experiment.log_metric(name, value, step=step)

    def _flush(self) -> None:
        self.experiment.flush()

    def _close(self) -> None:
        self.experiment.end()

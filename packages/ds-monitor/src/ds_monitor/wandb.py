"""Weights & Biases monitor (``deepspeed.monitor.wandb``): one W&B run, metrics logged at the sample step.

``wandb`` hands every ``log`` call to its own background service, which does the network I/O (or, with
``WANDB_MODE=offline``, writes the run to ``$WANDB_DIR/wandb/offline-run-*``); settings the config does not
cover (API key, mode, directory) come from wandb's environment variables and settings files.
"""

from __future__ import annotations

from typing import Any

from ds_config.monitor import WandbConfig
from ds_monitor._base import Monitor
from ds_monitor._events import Event
from ds_monitor.utils import import_backend

__all__ = ["WandbMonitor"]


class WandbMonitor(Monitor):
    """Logs events to a W&B run in ``project`` (``team`` as the entity, ``group`` to group runs)."""

    section = "wandb"
    config_model = WandbConfig

    def __init__(self, wandb_config: Any, *, rank: int | None = None) -> None:  # DeepSpeed's name
        super().__init__(wandb_config, rank=rank)

    @property
    def group(self) -> str | None:
        """The W&B group runs are grouped under (DeepSpeed's attribute; the config's ``group``)."""
        return self.monitor_config.group

    @property
    def team(self) -> str | None:
        """The W&B entity (DeepSpeed's attribute; the config's ``team``)."""
        return self.monitor_config.team

    @property
    def project(self) -> str:
        """The W&B project (DeepSpeed's attribute; the config's ``project``)."""
        return self.monitor_config.project

    run: Any = None
    """The ``wandb`` run (set on the writing rank)."""

    def _open(self) -> None:
        wandb = import_backend(self.section)
        cfg = self.monitor_config
        self.run = wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team)

    def _write(self, events: list[Event]) -> None:
        # one row per step: W&B keeps a single history row per step and rejects steps that go backwards
        rows: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            rows.setdefault(step, {})[name] = value
        for step, row in rows.items():
            self.run.log(row, step=step)

    def _close(self) -> None:
        self.run.finish()

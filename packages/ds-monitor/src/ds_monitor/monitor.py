"""The monitor master (``deepspeed.monitor.monitor``): fans events out to every enabled monitor.

The engine calls ``write_events([(name, value, step), ...])`` with the sample count as the step; on global
rank 0 the events go, in order, to TensorBoard, W&B, Comet and CSV on a background thread (so no training
step waits on disk or network I/O); on other ranks the call does nothing.
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from ds_config import validate_section
from ds_config.monitor import DeepSpeedMonitorConfig
from ds_monitor._base import Monitor, MonitorStartError
from ds_monitor._dispatch import BackgroundWriter
from ds_monitor._events import Event, normalize_events
from ds_monitor._rank import resolve_rank
from ds_monitor.comet import CometMonitor
from ds_monitor.csv_monitor import CSVMonitor
from ds_monitor.tensorboard import TensorBoardMonitor
from ds_monitor.utils import BACKENDS, require_backend
from ds_monitor.wandb import WandbMonitor

__all__ = ["Monitor", "MonitorMaster", "MonitorStartError"]

logger = logging.getLogger("ds_monitor")

_SECTIONS = ("tensorboard", "wandb", "comet", "csv_monitor")
# attribute, section, class: the attribute names are DeepSpeed's
_MONITORS = (("tb_monitor", "tensorboard", TensorBoardMonitor), ("wandb_monitor", "wandb", WandbMonitor),
             ("comet_monitor", "comet", CometMonitor), ("csv_monitor", "csv_monitor", CSVMonitor))


def as_monitor_config(config: Any) -> DeepSpeedMonitorConfig:
    """A ``DeepSpeedMonitorConfig`` from itself, a dict of the four sections, or a whole ``DeepSpeedConfig``."""
    if isinstance(config, DeepSpeedMonitorConfig):
        return config
    if config is None or isinstance(config, Mapping):
        return validate_section(DeepSpeedMonitorConfig, config)
    if all(hasattr(config, s) for s in _SECTIONS):
        return DeepSpeedMonitorConfig(**{s: getattr(config, s) for s in _SECTIONS})
    raise TypeError(f"monitor_config={config!r}: expected a DeepSpeedMonitorConfig, a DeepSpeedConfig or a dict "
                    f"with the sections {list(_SECTIONS)}")


class MonitorMaster:
    """Every enabled monitor behind one ``write_events``.

    ``rank``: the global rank (default: torch.distributed when initialised, else ``$RANK``, else 0); only rank 0
    writes, but every rank checks at start-up that the enabled backends are installed. ``background``: write on
    a background thread (the default) or inline in ``write_events``.
    """

    def __init__(self, monitor_config: Any, rank: int | None = None, background: bool = True) -> None:
        self.monitor_config = as_monitor_config(monitor_config)
        self.enabled: bool = self.monitor_config.enabled
        self.rank = resolve_rank(rank)
        self.tb_monitor: TensorBoardMonitor | None = None
        self.wandb_monitor: WandbMonitor | None = None
        self.comet_monitor: CometMonitor | None = None
        self.csv_monitor: CSVMonitor | None = None
        self._closed = False
        for section in BACKENDS:  # all missing packages are reported before any backend starts
            if getattr(self.monitor_config, section).enabled:
                require_backend(section)
        try:
            for attr, section, cls in _MONITORS:
                if getattr(self.monitor_config, section).enabled:
                    setattr(self, attr, cls(getattr(self.monitor_config, section), rank=self.rank))
        except BaseException:
            self._close_monitors()
            raise
        self._writer = BackgroundWriter() if background and self.monitors else None
        if self.monitors:
            atexit.register(self.close)

    @property
    def monitors(self) -> list[Monitor]:
        """The monitors that write in this process (none on ranks other than 0)."""
        found = (getattr(self, attr) for attr, _, _ in _MONITORS)
        return [m for m in found if m is not None and m.active]

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Send ``[(name, value, step), ...]`` to every enabled monitor; returns without waiting for them."""
        if self._closed or not self.monitors:
            return
        events = normalize_events(event_list)
        if self._writer is None:
            self._fan_out(events)
        else:
            self._writer.submit(functools.partial(self._fan_out, events))

    def flush(self, timeout: float = 30.0) -> bool:
        """Write everything queued so far and flush the backends; False if that took over ``timeout`` seconds."""
        if self._closed or not self.monitors:
            return True
        if self._writer is None:
            self._flush_monitors()
            return True
        return self._writer.submit(self._flush_monitors) and self._writer.drain(timeout)

    def close(self, timeout: float = 30.0) -> bool:
        """Write what is queued, then close every monitor (runs at exit too). Idempotent.

        False when the queued writes did not finish within ``timeout`` seconds; the monitors are then left to
        the backends' own exit handlers rather than closed under a writer that is still busy with them.
        """
        if self._closed:
            return True
        self._closed = True
        atexit.unregister(self.close)
        if self._writer is not None and not self._writer.stop(timeout):
            logger.warning("monitors did not finish writing within %.0f s at close; events still queued are lost",
                           timeout)
            return False
        self._close_monitors()
        return True

    def __repr__(self) -> str:
        names = [m.section for m in self.monitors]
        return f"MonitorMaster(enabled={self.enabled}, rank={self.rank}, writing_to={names})"

    def _fan_out(self, events: list[Event]) -> None:
        for monitor in self.monitors:
            monitor.write_events(events)

    def _flush_monitors(self) -> None:
        for monitor in self.monitors:
            monitor.flush()

    def _close_monitors(self) -> None:
        for attr, _, _ in _MONITORS:
            monitor = getattr(self, attr)
            if monitor is not None:
                monitor.close()

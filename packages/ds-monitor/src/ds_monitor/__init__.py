"""Training monitors: TensorBoard, Weights & Biases, Comet and CSV writers behind one MonitorMaster.

Each monitor takes its typed config section (``ds_config.monitor``: ``tensorboard``, ``wandb``, ``comet``,
``csv_monitor``); ``MonitorMaster`` takes all four and fans ``write_events([(name, value, step), ...])`` out to
the enabled ones on global rank 0. The backends are optional extras (``ds-monitor[tensorboard]``, ``[wandb]``,
``[comet]``, ``[all]``); nothing here imports torch or a backend until a monitor starts.
"""

from ds_monitor.__about__ import __version__
from ds_monitor._base import Monitor, MonitorStartError
from ds_monitor._events import Event, normalize_events
from ds_monitor._rank import resolve_rank
from ds_monitor.comet import CometMonitor
from ds_monitor.csv_monitor import CSVMonitor, csvMonitor
from ds_monitor.monitor import MonitorMaster, as_monitor_config
from ds_monitor.tensorboard import TensorBoardMonitor
from ds_monitor.utils import EventsLogScheduler, MonitorBackendMissing
from ds_monitor.wandb import WandbMonitor

__all__ = [
    "CSVMonitor",
    "CometMonitor",
    "Event",
    "EventsLogScheduler",
    "Monitor",
    "MonitorBackendMissing",
    "MonitorMaster",
    "MonitorStartError",
    "TensorBoardMonitor",
    "WandbMonitor",
    "__version__",
    "as_monitor_config",
    "csvMonitor",
    "normalize_events",
    "resolve_rank",
]

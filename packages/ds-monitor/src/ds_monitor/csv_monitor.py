"""CSV monitor (``deepspeed.monitor.csv_monitor``): one ``step,<metric>`` file per event name.

Files live in ``output_path/job_name``; ``Train/Samples/train_loss`` goes to ``Train_Samples_train_loss.csv``
with the header ``step,train_loss``. A restart appends to the same files: the header is written only into an
empty file, and a row torn by a crash is ended before new rows follow.
"""

from __future__ import annotations

import csv
import os
import re
from typing import Any

from ds_config.monitor import CSVConfig
from ds_monitor._base import Monitor
from ds_monitor._events import Event
from ds_monitor._paths import JobDirAttributes, job_dir

__all__ = ["CSVMonitor", "csvMonitor", "csv_filename", "csv_header"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def csv_filename(name: str) -> str:
    """The file of event ``name``: path separators, spaces and other unsafe characters become ``_``."""
    return _UNSAFE.sub("_", name) + ".csv"


def csv_header(name: str) -> list[str]:
    """The header row of event ``name``: ``step`` and the name's last ``/`` component, control characters as ``_``."""
    label = name.rsplit("/", 1)[-1]
    return ["step", "".join(ch if ch.isprintable() else "_" for ch in label)]


def _ends_torn(path: str) -> bool:
    """True when the file is non-empty and its last row has no line end (the writer died mid-row)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


class CSVMonitor(JobDirAttributes, Monitor):
    """Appends events to CSV files under ``output_path/job_name`` (``log_dir``), one file per event name."""

    section = "csv_monitor"
    config_model = CSVConfig

    def __init__(self, csv_config: Any, *, rank: int | None = None) -> None:  # DeepSpeed's name
        super().__init__(csv_config, rank=rank)

    log_dir: str | None = None
    """Directory of the CSV files (set on the writing rank)."""

    def _open(self) -> None:
        self.log_dir = job_dir(self.monitor_config.output_path, self.monitor_config.job_name, self.section)
        os.makedirs(self.log_dir, exist_ok=True)

    def _write(self, events: list[Event]) -> None:
        rows: dict[str, list[Event]] = {}
        for event in events:
            rows.setdefault(event[0], []).append(event)
        for name, group in rows.items():
            self._append(name, group)

    def _append(self, name: str, events: list[Event]) -> None:
        path = os.path.join(self.log_dir, csv_filename(name))
        torn = os.path.exists(path) and _ends_torn(path)
        with open(path, "a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            if torn:
                f.write("\n")
            if f.tell() == 0:
                writer.writerow(csv_header(name))
            writer.writerows([step, value] for _, value, step in events)


csvMonitor = CSVMonitor  # noqa: N816 - DeepSpeed's name for the class

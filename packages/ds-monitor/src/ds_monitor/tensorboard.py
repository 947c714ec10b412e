"""TensorBoard monitor (``deepspeed.monitor.tensorboard``): scalar events in ``output_path/job_name``.

Writes plain ``simple_value`` scalar summaries, the same records as ``torch.utils.tensorboard.SummaryWriter``
(so ``EventAccumulator.Scalars`` and the TensorBoard UI read them), with the ``tensorboard`` package's own
event-file writer: the extra ``ds-monitor[tensorboard]`` needs no torch.
"""

from __future__ import annotations

import time
from typing import Any

from ds_config.monitor import TensorBoardConfig
from ds_monitor._base import Monitor
from ds_monitor._events import Event
from ds_monitor._paths import JobDirAttributes, job_dir
from ds_monitor.utils import import_backend

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(JobDirAttributes, Monitor):
    """Writes events to a TensorBoard event file under ``output_path/job_name`` (``log_dir``).

    Each restart adds a new event file in the same directory; TensorBoard merges them.
    """

    section = "tensorboard"
    config_model = TensorBoardConfig

    def __init__(self, tensorboard_config: Any, *, rank: int | None = None) -> None:  # DeepSpeed's name
        super().__init__(tensorboard_config, rank=rank)

    log_dir: str | None = None
    """Directory of the event files (set on the writing rank)."""

    summary_writer: Any = None
    """The ``tensorboard`` EventFileWriter (set on the writing rank)."""

    def _open(self) -> None:
        import_backend(self.section)
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = job_dir(self.monitor_config.output_path, self.monitor_config.job_name, self.section)
        # the writer's own thread does the file I/O; flush_secs bounds how stale the file gets between flushes
        self.summary_writer = EventFileWriter(self.log_dir, max_queue_size=1000, flush_secs=30)

    def _write(self, events: list[Event]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event as EventProto
        from tensorboard.compat.proto.summary_pb2 import Summary

        now = time.time()
        for name, value, step in events:
            summary = Summary(value=[Summary.Value(tag=name, simple_value=value)])
            self.summary_writer.add_event(EventProto(wall_time=now, step=step, summary=summary))
        self.summary_writer.flush()

    def _flush(self) -> None:
        self.summary_writer.flush()

    def _close(self) -> None:
        self.summary_writer.close()

"""Progress bar, per-step log lines and the closing summary of the GPT example (printed by rank 0).

On a terminal, rank 0 draws a `tqdm <https://tqdm.github.io>`_ bar (redrawn in place with ``\\r``) and prints
the ``--log_interval`` lines above it. Anywhere else (CI, ``| tee``, launcher output redirected to a file) it
prints only those lines, so a log holds one line per report and no ``\\r`` frames.

Under the ``deepspeed`` launcher a rank's stdout is always a pipe to the launcher, which prefixes each line with
``[rankN]:`` and copies it to its own stdout; :func:`console_is_terminal` therefore asks whether *that* stdout is
a terminal. ``--progress bar|lines`` in train_gpt.py overrides the guess.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import TextIO

MIB = 1024 * 1024
_LAUNCHER_PREFIX = len("[rank0]: ")


def _fd_is_read_by_parent(fd: int) -> bool:
    """Whether ``fd`` is a pipe whose other end our parent process holds open (Linux ``/proc``)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        ours = os.readlink(f"/proc/self/fd/{fd}")  # "pipe:[12345]": both ends share the inode
        parent_fds = f"/proc/{os.getppid()}/fd"
        return any(os.readlink(os.path.join(parent_fds, name)) == ours for name in os.listdir(parent_fds))
    except OSError:
        return False


def _parent_stdout_columns() -> int | None:
    """Columns of the parent's stdout when it is a terminal, else None."""
    try:
        fd = os.open(f"/proc/{os.getppid()}/fd/1", os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        return None
    try:
        return (os.get_terminal_size(fd).columns or 80) if os.isatty(fd) else None
    except OSError:
        return 80
    finally:
        os.close(fd)


def console_columns(stream: TextIO | None = None) -> int | None:
    """Width of the terminal that shows ``stream`` (default stdout), or None when no terminal shows it.

    ``stream`` itself may be the terminal; or, as under the ``deepspeed`` launcher, it may be a pipe read by the
    parent process, which copies it to its own stdout: then the parent's stdout decides.
    """
    stream = sys.stdout if stream is None else stream
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None  # an in-memory stream (a test, a notebook capture)
    if os.isatty(fd):
        try:
            return os.get_terminal_size(fd).columns or 80  # a new pty reports 0 columns
        except OSError:
            return 80
    if _fd_is_read_by_parent(fd):
        columns = _parent_stdout_columns()
        return None if columns is None else max(40, columns - _LAUNCHER_PREFIX)
    return None


def console_is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stdout) ends up on a terminal; see :func:`console_columns`."""
    return console_columns(stream) is not None


class ProgressBar:
    """Rank 0's training progress: a tqdm bar on a terminal plus permanent lines from :meth:`log`.

    ``interactive``: None (default) draws the bar only when :func:`console_is_terminal`; False prints the
    :meth:`log` lines only (no ``\\r``); True always draws the bar. ``enabled=False`` prints nothing (other ranks).
    """

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None,
                 interactive: bool | None = None, ncols: int | None = None) -> None:
        self.total, self.enabled = total, enabled
        self.stream = stream if stream is not None else sys.stdout
        self._bar = None
        if not enabled:
            return
        columns = console_columns(self.stream)
        if interactive is None:
            interactive = columns is not None
        if interactive:
            try:
                from tqdm import tqdm
            except ImportError:  # outside the workspace env: lines only (pip install tqdm for the bar)
                return
            self._bar = tqdm(total=total, desc="train", unit="step", file=self.stream, ncols=ncols or columns or 100,
                             dynamic_ncols=False, mininterval=0.2, leave=True)

    @property
    def interactive(self) -> bool:
        """Whether a bar is drawn (else only the :meth:`log` lines are printed)."""
        return self._bar is not None

    def update(self, step: int, loss: float, lr: float) -> None:
        """Advance the bar to ``step`` (1-based) showing that step's loss (nats) and learning rate."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.1e}", refresh=False)
            self._bar.update(step - self._bar.n)

    def log(self, text: str) -> None:
        """Print a permanent line (above the bar when one is drawn)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def redirect_logging(self, *loggers: logging.Logger) -> contextlib.AbstractContextManager:
        """Context in which ``loggers``' console lines print above the bar instead of onto its line."""
        if self._bar is None:
            return contextlib.nullcontext()
        from tqdm.contrib.logging import logging_redirect_tqdm

        return logging_redirect_tqdm(loggers=list(loggers))

    def close(self) -> None:
        """Leave the final bar on screen and move to a new line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclass
class RunRecord:
    """What the summary reports; losses are global-batch means (nats), times in seconds."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    eval_before: float = float("nan")
    eval_after: float = float("nan")
    peak_bytes: list[int] = field(default_factory=list)  # one per rank
    sample_text: str = ""

    def samples_per_s(self, global_batch: int) -> float:
        """Training throughput (global samples/s) over every step after the first (warm-up excluded)."""
        steady = self.step_times[1:] or self.step_times
        return global_batch * len(steady) / sum(steady)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def format_summary(record: RunRecord, header: dict[str, str], global_batch: int, memory_kind: str) -> str:
    """The closing summary: ``header`` rows (model, data, ranks...) then loss, throughput and memory."""
    k = max(1, min(5, len(record.losses) // 2))
    rows = dict(header)
    rows["loss"] = (f"{record.losses[0]:.4f} -> {record.losses[-1]:.4f} (first -> last step); "
                    f"mean of first {k} {_mean(record.losses[:k]):.4f} -> last {k} {_mean(record.losses[-k:]):.4f}")
    rows["held-out loss"] = f"{record.eval_before:.4f} -> {record.eval_after:.4f} (before -> after training)"
    rows["throughput"] = (f"{record.samples_per_s(global_batch):.1f} samples/s (global, steps 2..{len(record.losses)}),"
                          f" train wall {sum(record.step_times):.1f} s")
    rows["peak memory"] = ", ".join(f"rank{r} {b / MIB:.1f} MiB" for r, b in enumerate(record.peak_bytes)) + (
        f" ({memory_kind})")
    if record.sample_text:
        rows["sample"] = record.sample_text
    return format_rows("summary", rows)


def format_rows(title: str, rows: dict[str, str]) -> str:
    """``title`` then one ``  key   value`` line per row, keys padded to one column (the summary's and the
    opening lines' layout)."""
    width = max(len(key) for key in rows)
    return "\n".join([title] + [f"  {key.ljust(width)}  {value}" for key, value in rows.items()])

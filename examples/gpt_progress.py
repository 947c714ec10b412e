"""Progress bar, per-step log lines and the closing summary of the GPT example (printed by rank 0).

The bar redraws one line ending in ``\\r``; the ``deepspeed`` launcher forwards ``\\r``-terminated lines with
the rank prefix, so it animates on a terminal and leaves every step's loss in a captured log.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

MIB = 1024 * 1024


class ProgressBar:
    """A one-line bar: ``train [#####.....] 50/100 loss 2.1034 lr 1.0e-03 212.4 samples/s eta 12s``."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.stream = stream if stream is not None else sys.stdout
        self.start = time.perf_counter()
        self._drawn = 0  # length of the bar line currently on screen (0: none)

    def _write(self, text: str, end: str) -> None:
        # pad to the previous bar's width so a shorter line fully overwrites it
        self.stream.write(text.ljust(self._drawn) + end)
        self.stream.flush()

    def update(self, step: int, loss: float, lr: float) -> None:
        """Redraw for ``step`` (1-based) with that step's loss (nats) and learning rate."""
        if not self.enabled:
            return
        done = int(self.width * step / self.total)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (self.total - step)
        line = (f"train [{'#' * done}{'.' * (self.width - done)}] {step}/{self.total} "
                f"loss {loss:.4f} lr {lr:.1e} {elapsed:.1f}s eta {eta:.0f}s")
        self._write(line, "\r")
        self._drawn = len(line)

    def log(self, text: str) -> None:
        """Print a permanent line over the bar; the next ``update`` draws the bar again below it."""
        if self.enabled:
            self._write(text, "\n")
            self._drawn = 0

    def close(self) -> None:
        """Leave the last bar on screen and move to a new line."""
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0


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
    width = max(len(key) for key in rows)
    return "\n".join(["summary"] + [f"  {key.ljust(width)}  {value}" for key, value in rows.items()])

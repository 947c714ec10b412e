"""Each fault test writes one record (fault, what the user sees, time to exit, what is preserved) as JSON into
``DS_FAULTS_RECORD_DIR`` when that is set; ``make_table.py`` turns the records of one run into docs/faults.md."""

from __future__ import annotations

import json
import os
import re

RECORD_DIR_ENV = "DS_FAULTS_RECORD_DIR"


def record(fault: str, seen: str, seconds: float | None, bound: str, preserved: str) -> None:
    """Store one row; ``seconds`` is the measured time to exit (None: nothing stops, e.g. a skipped step trains on)."""
    folder = os.environ.get(RECORD_DIR_ENV)
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9]+", "_", fault).strip("_")[:80]
    row = {"fault": fault, "seen": _one_line(seen), "seconds": seconds, "bound": bound, "preserved": preserved}
    with open(os.path.join(folder, f"{name}.json"), "w", encoding="utf-8") as handle:
        json.dump(row, handle, indent=1)


def _one_line(text: str, limit: int = 700) -> str:
    """A message as one table cell: the first line(s), paths of this run's temporary folder shortened."""
    text = " ".join(text.split())
    text = re.sub(r"/\S*/(pytest-of-[^/]+/)?pytest-\d+/[^/\s]+/", "<tmp>/", text)
    text = re.sub(r"/tmp/\S*?/(ckpt|swap|work)", r"<tmp>/\1", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."

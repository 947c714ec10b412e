"""Process-wide state of ``deepspeed.comm``: the comms logger and per-op call counters (for error messages)."""

from __future__ import annotations

from collections import Counter

from deepspeed.utils.comms_logging import CommsLogger

comms_logger = CommsLogger()
call_counts: Counter[str] = Counter()

"""The ``DeepSpeed`` logger and rank-aware helpers (``log_dist``, ``print_json_dist``).

Records look like DeepSpeed's: ``[2026-01-01 12:00:00,000] [INFO] [engine.py:123:step] message``; ``log_dist``
prefixes ``[Rank N]`` (``-1`` before the process group exists). ``DS_LOG_LEVEL`` (debug, info, warning, error,
critical) sets the initial level, INFO by default.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

LOG_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"
log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class LoggerFactory:
    @staticmethod
    def create_logger(name: str, level: int = logging.INFO) -> logging.Logger:
        """A logger writing to stdout in DeepSpeed's format, not propagating to the root logger."""
        if not name:
            raise ValueError("LoggerFactory.create_logger: name must be a non-empty string")
        made = logging.getLogger(name)
        made.setLevel(level)
        made.propagate = False
        if not any(getattr(h, "_deepspeed", False) for h in made.handlers):
            handler = logging.StreamHandler(stream=sys.stdout)
            handler.setFormatter(logging.Formatter(LOG_FORMAT))
            handler._deepspeed = True  # so a re-import does not stack a second handler
            made.addHandler(handler)
        return made


def _initial_level() -> int:
    name = os.environ.get("DS_LOG_LEVEL", "info").lower()
    if name not in log_levels:
        raise ValueError(f"DS_LOG_LEVEL={name!r} is not a log level; choose one of {sorted(log_levels)}")
    return log_levels[name]


logger = LoggerFactory.create_logger(name="DeepSpeed", level=_initial_level())


def _rank() -> int:
    """This process's global rank, or -1 before ``torch.distributed`` is initialised."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def _should_log(ranks: Iterable[int] | None) -> bool:
    """Before init every process logs; after, only the listed ranks (``[-1]``: all ranks)."""
    rank = _rank()
    if rank == -1:
        return True
    wanted = set(ranks or ())
    return -1 in wanted or rank in wanted


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` as ``[Rank N] message`` on the ranks in ``ranks`` (``[-1]`` = all; None = none once
    the process group exists, so library code can pass ``ranks=[0]`` to avoid one line per rank)."""
    if _should_log(ranks):
        logger.log(level, f"[Rank {_rank()}] {message}")


def print_json_dist(message: dict[str, Any], ranks: Iterable[int] | None = None, path: str | None = None) -> None:
    """Write ``message`` plus its rank as JSON to ``path`` on the selected ranks (same rule as ``log_dist``)."""
    if not _should_log(ranks):
        return
    if path is None:
        raise ValueError("print_json_dist: path is required (the JSON file to write)")
    with open(path, "w") as f:
        json.dump({**message, "rank": _rank()}, f)
        f.write("\n")


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level is at or below ``max_log_level_str`` (e.g. ``"info"``)."""
    name = max_log_level_str.lower()
    if name not in log_levels:
        raise ValueError(f"should_log_le: {max_log_level_str!r} is not a log level; choose one of {sorted(log_levels)}")
    return get_current_level() <= log_levels[name]


def get_log_level_from_string(log_level_str: str) -> int:
    """``"info"`` -> ``logging.INFO`` (case-insensitive); an unknown name is an error listing the accepted ones."""
    name = log_level_str.lower()
    if name not in log_levels:
        raise ValueError(f"{log_level_str!r} is not a log level; choose one of {sorted(log_levels)}")
    return log_levels[name]


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set ``custom_logger`` (default: DeepSpeed's logger) and its handlers to the named level."""
    target = logger if custom_logger is None else custom_logger
    level = get_log_level_from_string(log_level_str)
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)

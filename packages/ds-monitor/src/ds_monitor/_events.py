"""Events as the engine emits them: ``(name, value, step)`` with the sample count as the step."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

__all__ = ["Event", "normalize_events", "redact"]

Event = tuple[str, float, int]
"""``(name, value, step)``: a metric name such as ``Train/Samples/train_loss``, its value, the step."""

_MASK = "**********"


def normalize_events(event_list: Iterable[Any]) -> list[Event]:
    """Check and convert events to ``(str, float, int)``.

    Values may be anything ``float()`` accepts (Python and numpy numbers, one-element tensors); steps anything
    with ``__index__``. Converting here, on the caller's thread, means no backend keeps a tensor alive.
    """
    if isinstance(event_list, (str, bytes)) or not isinstance(event_list, Iterable):
        raise TypeError(f"event_list={event_list!r}: expected a list of (name, value, step) tuples")
    events = []
    for i, event in enumerate(event_list):
        try:
            name, value, step = event
        except (TypeError, ValueError):
            raise ValueError(f"event_list[{i}]={event!r}: expected a (name, value, step) tuple") from None
        if not isinstance(name, str) or not name:
            raise TypeError(f"event_list[{i}]: name={name!r}: expected a non-empty str")
        try:
            value = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"event_list[{i}] ({name!r}): value={value!r} is not a number") from None
        try:
            step = operator.index(step)
        except TypeError:
            raise TypeError(f"event_list[{i}] ({name!r}): step={step!r}: expected an int (samples seen)") from None
        events.append((name, value, step))
    return events


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every non-empty secret replaced by a mask."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, _MASK)
    return text

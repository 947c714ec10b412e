"""User-facing configuration errors: every problem names its full key path, the bad value and what is accepted."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass(frozen=True)
class ConfigProblem:
    """One problem in a config: where (dotted key path), what is wrong, and the offending value."""

    path: str
    message: str
    value: Any = _MISSING

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # the "no value" marker is this process's object
        return type(self), (self.path, self.message) if self.value is _MISSING else (self.path, self.message,
                                                                                       self.value)

    def __str__(self) -> str:
        where = self.path or "<config>"
        if self.value is _MISSING:
            return f"{where}: {self.message}"
        return f"{where}: {self.message} (got {_short_repr(self.value)})"


class ConfigError(ValueError):
    """A DeepSpeed config that cannot be used as written.

    ``problems`` lists every problem found, each with its dotted key path
    (``zero_optimization.offload_param.device``); ``str(err)`` shows them all.
    """

    def __init__(self, problems: ConfigProblem | Sequence[ConfigProblem] | str, path: str = "",
                 value: Any = _MISSING) -> None:
        if isinstance(problems, str):
            problems = [ConfigProblem(path, problems, value)]
        elif isinstance(problems, ConfigProblem):
            problems = [problems]
        self.problems: list[ConfigProblem] = list(problems)
        super().__init__(self._render())

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # rebuilt from the problems (a rank's error re-raised in its parent keeps its paths and message, instead
        # of the rendered text becoming one pathless problem)
        return type(self), (self.problems,)

    @property
    def paths(self) -> list[str]:
        return [p.path for p in self.problems]

    def _render(self) -> str:
        if len(self.problems) == 1:
            return f"Invalid DeepSpeed config: {self.problems[0]}"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"Invalid DeepSpeed config ({len(self.problems)} problems):\n{lines}"


def join_path(*parts: Any) -> str:
    """Dotted key path; list indices render as ``[i]``."""
    out = ""
    for part in parts:
        if part in ("", None):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest known key, or '' when nothing is close."""
    known = list(known)
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not match:
        lowered = {k.lower(): k for k in known}
        match = [lowered[key.lower()]] if key.lower() in lowered else []
    if not match:  # a word of a longer key ('step' for 'profile_step'), when only one key has it
        match = [k for k in known if key.lower() in k.lower().split("_") and len(key) >= 3]
        match = match if len(match) == 1 else []
    return f" (did you mean '{match[0]}'?)" if match else ""


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""DeepSpeed's Autotuner (spec 12): ``deepspeed --autotuning tune|run`` searches ZeRO stages, micro-batch sizes and
ZeRO knobs by running the user's script as short launcher jobs and keeps the fastest configuration.

Modules: :mod:`.autotuner` (the search), :mod:`.scheduler` (experiments as launcher jobs), :mod:`.tuner`
(grid, random and cost-model search over a tuning space), :mod:`.utils` (config-dict helpers), :mod:`.constants`
(templates and default tuning spaces). The engine side (metric and model-info files) is ``probe``.
This package never imports torch except in ``probe``, which runs inside the training ranks.

Time limit: each experiment (a launcher job) may run ``DS_AUTOTUNING_EXP_TIMEOUT`` seconds (environment variable,
default 1800; the ``autotuning`` config section documents no such key) before it and its ranks are killed and it
is recorded as failed (``status: failed``, ``error: timed out after N s``) and skipped.

Baseline: the user's own config (each list's first value, ZeRO stage 0 for ``"all"``) is always measured, so the
optimum is chosen among candidates that include it; ``summary.txt`` names it with the optimum's ratio to it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepspeed.autotuning.autotuner import Autotuner

__all__ = ["Autotuner"]

_SUBMODULES = ("autotuner", "constants", "scheduler", "tuner", "utils")


def __getattr__(name: str) -> Any:
    """Load the search lazily: every engine imports ``probe`` from here, and a job that does not tune must
    not pay for the Autotuner's modules (and their tqdm import)."""
    if name == "Autotuner":
        from deepspeed.autotuning.autotuner import Autotuner

        return Autotuner
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""How ZenFlow shares a rank's CPU cores between its CPU optimizer workers and the training thread.

``zero_optimization.zenflow.pt_reserved_cores_perc`` is the fraction kept for PyTorch (the training
thread); the optimizer workers get the rest, so the offloaded step does not compete with the forward and
backward passes for cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["split_affinity"]


def split_affinity(cores: Sequence[int], pt_reserved_cores_perc: float) -> tuple[list[int], list[int]]:
    """``(optimizer cores, training cores)`` of one rank's ``cores``.

    The training side takes the first ``ceil(pt_reserved_cores_perc * len(cores))`` cores and the
    optimizer the others. When that count is 0 or every core, one side would be empty, so both share all
    of them (isolation buys nothing then).
    """
    if not 0.0 <= pt_reserved_cores_perc <= 1.0:
        raise ValueError(f"pt_reserved_cores_perc: must be a fraction in [0, 1] (got {pt_reserved_cores_perc!r})")
    cores = list(cores)
    reserved = math.ceil(pt_reserved_cores_perc * len(cores))
    if 0 < reserved < len(cores):
        return cores[reserved:], cores[:reserved]
    return cores, list(cores)


_split_affinity = split_affinity  # DeepSpeed's name at deepspeed.runtime.zenflow.zenflow_utils

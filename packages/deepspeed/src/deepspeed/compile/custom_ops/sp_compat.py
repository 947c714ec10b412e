"""The torch version AutoSP's graph passes need: 2.9 or newer (symbolic sequence lengths in Dynamo graphs and
custom-op fake kernels that keep them)."""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 9)


def check_autosp_compatibility(version: str | None = None) -> None:
    """Raise ``RuntimeError`` when ``version`` (default: the installed torch) is older than 2.9; local build tags
    (``+cu128``) and pre-release parts are ignored."""
    found = str(torch.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None:
        raise ValueError(f"AutoSP: cannot read the torch version {found!r} (expected MAJOR.MINOR...)")
    if (int(match[1]), int(match[2])) < MIN_TORCH:
        raise RuntimeError(f"AutoSP requires PyTorch >= {'.'.join(map(str, MIN_TORCH))}, found {found}")


_check_autosp_compatibility = check_autosp_compatibility  # DeepSpeed's name

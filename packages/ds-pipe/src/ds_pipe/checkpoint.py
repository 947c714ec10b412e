"""Reading a pipeline checkpoint's layer files without the pipeline: one state dict for the whole model.

A pipeline checkpoint keeps every layer's weights in ``<tag>/layer_XX-model_states.pt`` (``-model_YY`` before the
suffix with a tensor-parallel axis), keyed relative to the layer. ``consolidated_state_dict(tag_dir)`` prefixes each
key with its layer index, which is the state dict of ``torch.nn.Sequential(*layers)`` built from the same layers:
the trained model loads outside the pipeline (and outside DeepSpeed).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

_LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")


def layer_files(tag_dir: str | os.PathLike, model_rank: int = 0) -> dict[int, str]:
    """``{layer index: path}`` of the layer files in ``tag_dir`` (those of tensor-parallel rank ``model_rank``)."""
    tag_dir = os.fspath(tag_dir)
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"pipeline checkpoint directory {tag_dir} does not exist")
    found: dict[int, str] = {}
    for name in sorted(os.listdir(tag_dir)):
        match = _LAYER_FILE.match(name)
        if match and int(match.group(2) or 0) == model_rank:
            found[int(match.group(1))] = os.path.join(tag_dir, name)
    if not found:
        raise FileNotFoundError(f"{tag_dir} holds no pipeline layer files (layer_XX-model_states.pt): it is not a "
                                "pipeline checkpoint's tag directory")
    return found


def consolidated_state_dict(tag_dir: str | os.PathLike, model_rank: int = 0) -> dict[str, Any]:
    """Every layer's weights as one state dict with keys ``"<layer index>.<key>"`` (``nn.Sequential``'s)."""
    merged: dict[str, Any] = {}
    for index, path in sorted(layer_files(tag_dir, model_rank).items()):
        weights = torch.load(path, map_location="cpu", weights_only=True)
        merged.update({f"{index}.{key}": value for key, value in weights.items()})
    return merged

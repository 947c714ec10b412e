"""The AutoEP layout recorded in a ZeRO-1/2 checkpoint's model-states files, gathered and checked across the
files before a conversion (``ds_to_universal._aggregate_autoep_zero12_metadata``, DeepSpeed's name)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepspeed.checkpoint.constants import AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_LAYERS_KEY, PARAM_SHAPES

USE_DATA_BEFORE_EXPERT_PARALLELISM = "use_data_before_expert_parallelism"


def _layers_of(model_file: str, layers: Any, by_prefix: dict[str, dict], source: dict[str, str]) -> None:
    if not isinstance(layers, list):
        raise RuntimeError(f"AutoEP metadata must be a list in {model_file}.")
    for layer in layers:
        if not isinstance(layer, dict):
            raise RuntimeError(f"AutoEP layer metadata must contain dictionaries in {model_file}.")
        prefix = layer.get(AUTOEP_EXPERT_KEY_PREFIX)
        if not isinstance(prefix, str) or not prefix:
            raise RuntimeError(f"AutoEP expert_key_prefix must be a non-empty string in {model_file}.")
        if prefix in by_prefix and by_prefix[prefix] != layer:
            raise RuntimeError(f"Conflicting AutoEP metadata for expert_key_prefix {prefix!r} in {source[prefix]} "
                               f"and {model_file}.")
        by_prefix.setdefault(prefix, layer)
        source.setdefault(prefix, model_file)


def aggregate_autoep_zero12_metadata(
        model_state_metadata: Sequence[tuple[str, dict[str, Any]]]) -> tuple[list[dict], list[dict] | None, bool]:
    """From ``DeepSpeedCheckpoint.model_state_metadata``: each file's ``{name: shape}`` (pipeline-major order), the
    AutoEP layers of all files (one entry per expert key prefix; None without AutoEP) and the job's
    ``use_data_before_expert_parallelism``. RuntimeError names the file whose metadata is malformed or disagrees."""
    shapes_by_file, by_prefix, source, ordering = [], {}, {}, {}
    for model_file, metadata in model_state_metadata:
        shapes = metadata[PARAM_SHAPES]
        if not isinstance(shapes, dict):
            raise RuntimeError(f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {model_file}.")
        shapes_by_file.append(shapes)
        if metadata[AUTOEP_LAYERS_KEY] is not None:
            _layers_of(model_file, metadata[AUTOEP_LAYERS_KEY], by_prefix, source)
        config = metadata["ds_config"]
        if not isinstance(config, dict):
            raise RuntimeError(f"DeepSpeed checkpoint ds_config must be a dictionary in {model_file}.")
        value = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        if not isinstance(value, bool):
            raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} must be a boolean in "
                               f"{model_file}.")
        ordering[model_file] = value
    if len(set(ordering.values())) != 1:
        raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} disagrees across model-state "
                           f"files: {ordering}")
    return shapes_by_file, list(by_prefix.values()) or None, next(iter(ordering.values()))

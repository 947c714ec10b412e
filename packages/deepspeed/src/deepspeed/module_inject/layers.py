"""``deepspeed.module_inject.layers``: AutoTP's tensor-parallel layers (from ``ds_inference.autotp``) and the
universal-checkpoint description they publish, under DeepSpeed's names.

Each sharded parameter carries ``ds_autotp_universal_checkpoint_meta`` (:mod:`ds_inference.autotp.uc_meta`);
:func:`collect_autotp_universal_checkpoint_info` turns a model's descriptions into the pattern lists a
checkpoint's ``universal_checkpoint_info`` holds, which ``ds_to_universal`` follows to merge the ranks' slices.
Hand-built layers split by the model facts of :mod:`deepspeed.module_inject.tp_shard` (imported here, which
installs them as the split rule's source).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

import deepspeed.module_inject.tp_shard  # noqa: F401 - installs the model facts the split rule reads
import ds_inference.autotp as _autotp
from deepspeed.checkpoint.constants import (
    AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
    ORIGINAL_VOCAB_SIZE,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)
from ds_inference.autotp import (
    Conv_LinearALlreduce,
    EmbeddingLayer,
    GateUpPack_LinearLayer,
    HiddenParallelEmbedding,
    LinearAllreduce,
    LinearLayer,
    LmHeadLinearAllreduce,
    Normalize,
    SubParamLinearAllreduce,
    SubParamLinearLayer,
    TensorParallel_Layer,
    VocabParallelEmbedding,
    Yuan_LinearAllreduce,
    Yuan_LinearLayer,
    conv_LinearLayer,
    fused_LinearLayer,
    get_auto_tp_mode,
    is_autotp_training_mode,
    set_autotp_mode,
)
from ds_inference.autotp.split_rules import subparam_widths
from ds_inference.autotp.uc_meta import build_conversion_meta, build_restore_meta, conversion_meta

__all__ = [
    "Conv_LinearALlreduce", "EmbeddingLayer", "GateUpPack_LinearLayer", "HiddenParallelEmbedding", "LinearAllreduce",
    "LinearLayer", "LmHeadLinearAllreduce", "Normalize", "SubParamLinearAllreduce", "SubParamLinearLayer",
    "TensorParallel_Layer", "VocabParallelEmbedding", "Yuan_LinearAllreduce", "Yuan_LinearLayer",
    "collect_autotp_universal_checkpoint_info", "conv_LinearLayer", "fused_LinearLayer", "get_auto_tp_mode",
    "is_autotp_training_mode", "set_autotp_mode",
]



def __getattr__(name: str) -> Any:
    """The rest of AutoTP's public names (this path served all of ``ds_inference.autotp`` before)."""
    if name in _autotp.__all__:
        return getattr(_autotp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# DeepSpeed's private helper names (its own tests import them)
_build_param_uc_conversion_meta = build_conversion_meta
_build_param_uc_restore_meta = build_restore_meta


def _get_param_uc_conversion_meta(param: Any) -> dict[str, Any] | None:
    """The ``conversion`` view of a parameter's universal-checkpoint description (None without one)."""
    return conversion_meta(param)


def _subparam_shard_widths(subparam_sizes: Any, tp_world_size: int, name: Any = None) -> list[list[int]]:
    """Per-rank widths of each sub-parameter (``widths[i][r]``), by the split rule and ``tp_shard``'s facts."""
    return subparam_widths(subparam_sizes, tp_world_size, name)


def _is_vocabulary(full_name: str, meta: dict[str, Any]) -> bool:
    shape = meta.get("original_shape")
    return bool(shape) and len(shape) == 2 and meta.get("partition_dim") == 0 and (
        "embed" in full_name or "lm_head" in full_name)


def collect_autotp_universal_checkpoint_info(model: nn.Module) -> dict[str, Any]:
    """The model-level conversion rules of an AutoTP model (``universal_checkpoint_info``): which parameters are
    row-parallel, replicated (every parameter AutoTP left alone, and replicated biases), vocabulary, fused
    (with their sub-parameter sizes and per-rank widths), or unsupported (with the reason). Each layer's
    description is refreshed first; tied aliases are described once, under the name the optimizer knows."""
    row, replicated, vocabulary, with_sub_params = [], [], [], []
    widths_by_pattern: dict[str, list[list[int]]] = {}
    unsupported: dict[str, str] = {}
    original_vocab_size = None
    canonical = {id(param): name for name, param in model.named_parameters()}
    for module_name, module in model.named_modules():
        marker = getattr(module, "_mark_uc_metadata", None)
        if marker is not None:
            marker()
        for param_name, param in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            if canonical.get(id(param), full_name) != full_name:
                continue
            pattern = rf"^{re.escape(full_name)}$"
            meta = conversion_meta(param)
            if not meta:  # untouched by AutoTP: the same on every rank
                replicated.append(pattern)
                continue
            if meta.get("unsupported_reason"):
                unsupported[pattern] = meta["unsupported_reason"]
                continue
            if meta.get("replicated"):
                replicated.append(pattern)
            if meta.get("partition_type") == "row" and not meta.get("is_bias", False):
                row.append(pattern)
            if _is_vocabulary(full_name, meta):
                vocabulary.append(pattern)
                original_vocab_size = original_vocab_size or meta["original_shape"][0]
            entry = _sub_param_entry(pattern, meta, widths_by_pattern)
            if entry is not None:
                with_sub_params.append(entry)
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(set(row)),
            TP_REPLICATED_PARAMETER_PATTERNS: sorted(set(replicated)),
            VOCABULARY_PARAMETER_PATTERNS: sorted(set(vocabulary)),
            PARAMETER_WITH_SUB_PARAMS: with_sub_params,
            AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: unsupported}
    if widths_by_pattern:
        info[SUB_PARAM_SHARD_WIDTHS] = widths_by_pattern
    if original_vocab_size is not None:
        info[ORIGINAL_VOCAB_SIZE] = original_vocab_size
    return info


def _sub_param_entry(pattern: str, meta: dict[str, Any], widths_by_pattern: dict[str, list[list[int]]]) -> Any:
    """The ``parameter_with_sub_params`` entry of a fused parameter (None for others). With recorded widths the
    published shape holds the sub-parameters' real sizes at the split dimension, never a count (``(3, -1)``),
    which a converter could read as a width."""
    shape, dim = meta.get("sub_param_shape"), meta.get("partition_dim")
    if shape is None or dim is None:
        return None
    published = list(shape)
    widths = meta.get("sub_param_shard_widths")
    if widths is not None:
        published[dim] = tuple(sum(per_rank) for per_rank in widths)
        widths_by_pattern[pattern] = [list(per_rank) for per_rank in widths]
    return {"patterns": [pattern], "shape": published, "partition_dim": dim}

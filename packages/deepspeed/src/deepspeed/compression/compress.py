"""``init_compression`` and ``redundancy_clean``: the two calls around compression-aware training.

``init_compression(model, ds_config)`` converts the layers the ``compression_training`` groups name (regexes over
``model.named_modules()`` names) to compression-aware layers and configures them; the compression scheduler (which
the engine steps after every optimizer step) switches each technique on at its ``schedule_offset``. After
training, ``redundancy_clean(model, ds_config)`` bakes the techniques into the weights and physically removes
pruned rows, heads and channels from the layers and from their ``related_modules``.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from deepspeed.compression.config import SECTION, TECHNIQUES, get_compression_config, merged_parameters
from deepspeed.compression.helper import (
    compression_preparation,
    fix_compression,
    is_module_compressible,
    mp_linear_types,
    recursive_getattr,
)
from deepspeed.compression.layer_reduction import student_initialization
from deepspeed.utils.logging import logger
from ds_config import CompressionConfig

ALL_MODULES = "*"
_SCOPE: dict[str, tuple[type[nn.Module], ...]] = {
    "weight_quantization": (nn.Linear, nn.Conv2d, nn.Embedding),
    "activation_quantization": (nn.Linear, nn.Conv2d),
    "sparse_pruning": (nn.Linear, nn.Conv2d),
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d,),
}
"""Layer types each technique applies to (``"*"``: every Linear and Conv2d layer of that scope)."""
_RELATED_SCOPE: dict[str, tuple[type[nn.Module], ...]] = {
    "row_pruning": (nn.Linear,), "head_pruning": (nn.Linear,), "channel_pruning": (nn.Conv2d, nn.BatchNorm2d)}


def check_deepspeed_config(config: Any) -> CompressionConfig:
    """The typed ``compression_training`` section of a config dict, JSON path or ``DeepSpeedConfig``."""
    return get_compression_config(config)


def get_module_name(group_name: str, model: nn.Module, key_word: str, exist_module_name: set[str], mpu: Any = None,
                    verbose: bool = True, types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d)):
    """Names of the compressible ``types`` modules whose name matches the regex ``key_word`` (``"*"``: all), and
    ``exist_module_name`` updated. A module claimed by two groups of one technique is an error (``verbose``)."""
    try:
        pattern = None if key_word == ALL_MODULES else re.compile(key_word)
    except re.error as exc:
        raise ValueError(f"{SECTION} group {group_name!r}: module pattern {key_word!r} is not a valid regular "
                         f"expression ({exc})") from None
    if pattern is None:  # the documented default scope: "All Linear and CONV2D layers" (embeddings only by name)
        types = tuple(t for t in types if t in (nn.Linear, nn.Conv2d))
    found = []
    for name, module in model.named_modules():
        # an mpu's model-parallel linears count as Linear layers
        linear_like = nn.Linear in types and mpu is not None and isinstance(module, mp_linear_types(mpu))
        if not (is_module_compressible(module, mpu) and (isinstance(module, types) or linear_like)):
            continue
        if pattern is not None and pattern.search(name) is None:
            continue
        if name in exist_module_name:
            if verbose:
                raise ValueError(f"{SECTION} group {group_name!r}: module {name!r} is already compressed by another "
                                 "group of the same technique; make the groups' modules patterns disjoint")
            continue
        exist_module_name.add(name)
        found.append(name)
    return found, exist_module_name


def _describe(technique: str, group_name: str, key_word: str, types: tuple[type[nn.Module], ...]) -> str:
    kinds = "/".join(t.__name__ for t in types)
    return (f"{SECTION}.{technique}.different_groups.{group_name}: pattern {key_word!r} matches no {kinds} module "
            "of the model (names are matched with re.search against model.named_modules())")


def _names_or_error(technique: str, group_name: str, model: nn.Module, key_word: str, claimed: set[str],
                    mpu: Any, types: tuple[type[nn.Module], ...]) -> list[str]:
    names, _ = get_module_name(group_name, model, key_word, claimed, mpu=mpu, types=types)
    if not names:
        raise ValueError(_describe(technique, group_name, key_word, types))
    return names


def _related_names(technique: str, group_name: str, model: nn.Module, related: list[str], primary: list[str],
                   mpu: Any) -> list[list[str]]:
    """For one primary pattern: one name list per related pattern, each lined up with ``primary``."""
    lists = []
    for key_word in related:
        names = _names_or_error(technique, group_name, model, key_word, set(), mpu, _RELATED_SCOPE[technique])
        if len(names) != len(primary):
            raise ValueError(f"{SECTION}.{technique}.different_groups.{group_name}.related_modules: {key_word!r} "
                             f"matches {len(names)} modules but the pruned pattern matches {len(primary)} "
                             f"({primary}); each pruned module needs exactly one related module per pattern")
        lists.append(names)
    return lists


def _excluded(name: str, shared: Any) -> bool:
    """Sparse pruning's ``excluded_modules`` (regexes, ``re.search`` as ``modules``): never pruned, e.g. the
    output layer when the groups say ``"*"``."""
    patterns = getattr(shared, "excluded_modules", None) or ()
    try:
        return any(re.search(p, name) for p in patterns)
    except re.error as exc:
        raise ValueError(f"{SECTION}.sparse_pruning.shared_parameters.excluded_modules: {patterns} holds an invalid "
                         f"regular expression ({exc})") from None


def get_compress_methods(model: nn.Module, compress_methods: CompressionConfig, mpu: Any = None) -> list:
    """Per enabled technique and group: ``[module_name_lists, related_module_name_lists, {technique: params}]``
    (one name list per ``modules`` pattern; per pattern one name list per related pattern)."""
    items = []
    for technique in TECHNIQUES:
        section = getattr(compress_methods, technique)
        if not section.shared_parameters.enabled:
            continue
        claimed: set[str] = set()
        for group_name, group in section.different_groups.items():
            related = getattr(group, "related_modules", None)
            module_lists, related_lists = [], []
            for i, key_word in enumerate(group.modules):
                names, _ = get_module_name(group_name, model, key_word, claimed, mpu=mpu, types=_SCOPE[technique])
                excluded = {n for n in names if _excluded(n, section.shared_parameters)}
                names, claimed = [n for n in names if n not in excluded], claimed - excluded
                if not names:  # one config may serve several models: only a group matching nothing is an error
                    logger.warning(_describe(technique, group_name, key_word, _SCOPE[technique]))
                module_lists.append(names)
                if related:
                    related_lists.append(_related_names(technique, group_name, model, related[i], names, mpu)
                                         if names else [])
            if not any(module_lists):
                raise ValueError(_describe(technique, group_name, " | ".join(group.modules), _SCOPE[technique]))
            params = merged_parameters(compress_methods, technique, group)
            items.append([module_lists, related_lists, {technique: params}])
    return items


def _check_supported(config: CompressionConfig) -> None:
    sparse = config.sparse_pruning.shared_parameters
    if sparse.enabled and sparse.method == "snip_momentum":
        raise ValueError(f"{SECTION}.sparse_pruning.shared_parameters.method: 'snip_momentum' needs Intel Neural "
                         "Compressor's pruners, which this version does not include; accepted here: 'l1', 'topk'")


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None,
                     mpu: Any = None) -> nn.Module:
    """Prepare ``model`` for compression-aware training as ``deepspeed_config``'s ``compression_training`` says:
    layer reduction from ``teacher_model`` (required when enabled), then the configured layers converted to
    compression-aware layers in place. Returns ``model``."""
    config = get_compression_config(deepspeed_config)
    _check_supported(config)
    c_model = getattr(model, "module", model)
    if config.layer_reduction.enabled:
        if teacher_model is None:
            raise ValueError(f"{SECTION}.layer_reduction is enabled: init_compression needs teacher_model, the "
                             "model whose layers initialize the student")
        student_initialization(c_model, getattr(teacher_model, "module", teacher_model), config)
    compression_preparation(c_model, get_compress_methods(c_model, config, mpu=mpu), mpu)
    return model


def _fix_group(c_model: nn.Module, module_lists: list, related_lists: list, technique: dict[str, dict]) -> None:
    for i, names in enumerate(module_lists):
        related = related_lists[i] if related_lists else []
        masks = [fix_compression(c_model, name, technique, dim_reduction=bool(related)) for name in names]
        for rel_names in related:
            for mask, name in zip(masks, rel_names, strict=True):
                fix_compression(c_model, name, technique, mask=mask, dim_reduction=True)
        if related and "head_pruning" in technique:
            _update_attention_heads(c_model, [n for rel in related for n in rel], masks)


def _update_attention_heads(c_model: nn.Module, qkv_names: list[str], masks: list) -> None:
    """Tell the attention modules owning the shrunk Q/K/V how many heads they have left (HF-style attributes)."""
    per_layer = len(masks)
    for idx, name in enumerate(qkv_names):
        parent = recursive_getattr(c_model, name.rpartition(".")[0])
        kept = int(masks[idx % per_layer].sum())
        out = recursive_getattr(c_model, name).out_features
        for attr, value in (("num_attention_heads", kept), ("num_heads", kept), ("all_head_size", out)):
            if isinstance(getattr(parent, attr, None), int):
                setattr(parent, attr, value)


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Bake the compression into ``model``: quantized weights stored quantize-dequantized at ``target_bits``,
    sparse masks applied, pruned rows/heads/channels removed where ``related_modules`` are given (their matching
    input dimension removed too; without them the pruned slices are zeroed). Activation quantization stays
    active. Returns ``model``."""
    config = get_compression_config(deepspeed_config)
    c_model = getattr(model, "module", model)
    for module_lists, related_lists, technique in get_compress_methods(c_model, config, mpu=mpu):
        _fix_group(c_model, module_lists, related_lists, technique)
    return model


__all__ = ["init_compression", "redundancy_clean", "student_initialization", "get_compress_methods",
           "get_module_name", "check_deepspeed_config"]

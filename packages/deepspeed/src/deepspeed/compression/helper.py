"""Module plumbing of the compression library: find modules by dotted name, convert plain layers to their
compression-aware classes (in place, so parameters, hooks and weight tying survive), configure the techniques on
them, and bake a technique in (``fix_compression``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepspeed.compression.basic_layer import (
    COMPRESS_CLASSES,
    ColumnParallelLinear_Compress,
    RowParallelLinear_Compress,
)

COMPRESSIBLE_TYPES = tuple(plain for plain, _ in COMPRESS_CLASSES)
_COMPRESS_TYPES = tuple(compress for _, compress in COMPRESS_CLASSES)


def recursive_getattr(model: nn.Module, module_name: str) -> Any:
    """``model.<a>.<b>...`` for ``module_name = "a.b..."`` (the empty name is ``model`` itself)."""
    output = model
    for name in filter(None, module_name.split(".")):
        output = getattr(output, name)
    return output


def recursive_setattr(model: nn.Module, module_name: str, module: Any) -> None:
    """Set ``model.<a>.<b>... = module`` for ``module_name = "a.b..."``."""
    *parents, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(parents)), last, module)


def mp_linear_types(mpu: Any) -> tuple[type, ...]:
    """The model-parallel linears compressed as linears: the compression classes and, when ``mpu`` has them, its
    Megatron ``ColumnParallelLinear`` / ``RowParallelLinear``."""
    found: list[type] = [ColumnParallelLinear_Compress, RowParallelLinear_Compress]
    if mpu is not None:
        found += [t for t in (getattr(mpu, "ColumnParallelLinear", None), getattr(mpu, "RowParallelLinear", None))
                  if isinstance(t, type)]
    return tuple(found)


def is_module_compressible(module: nn.Module, mpu: Any = None) -> bool:
    """True for exactly ``nn.Linear``/``nn.Conv2d``/``nn.Embedding``/``nn.BatchNorm2d``, their compression classes
    and (with ``mpu``) the mpu's ``ColumnParallelLinear``/``RowParallelLinear``. Other subclasses (e.g.
    ``MultiheadAttention``'s ``out_proj``) are skipped: their own ``forward`` or their owner reads the weight
    directly, so a compressed forward would not be used."""
    return (type(module) in COMPRESSIBLE_TYPES or isinstance(module, _COMPRESS_TYPES)
            or (mpu is not None and isinstance(module, mp_linear_types(mpu))))


def _convert_model_parallel(module: nn.Module, mpu: Any) -> nn.Module:
    """A Megatron model-parallel linear as its compression class, holding the same weight and bias Parameters."""
    bias = getattr(module, "bias", None)
    if isinstance(module, getattr(mpu, "ColumnParallelLinear", ())):
        new = ColumnParallelLinear_Compress(mpu, module.input_size, module.output_size, bias=bias is not None,
                                            gather_output=module.gather_output, skip_bias_add=module.skip_bias_add)
    else:
        new = RowParallelLinear_Compress(mpu, module.input_size, module.output_size, bias=bias is not None,
                                         input_is_parallel=module.input_is_parallel,
                                         skip_bias_add=module.skip_bias_add)
    if tuple(new.weight.shape) != tuple(module.weight.shape):
        raise ValueError(f"{type(module).__name__}: weight shard {tuple(module.weight.shape)} does not match the "
                         f"model-parallel split {tuple(new.weight.shape)} of mpu.get_model_parallel_world_size()")
    new.weight = module.weight
    if bias is not None:
        new.bias = bias
    new.train(module.training)
    return new


def convert_module(module: nn.Module, mpu: Any = None) -> nn.Module:
    """``module`` as its compression-aware class: converted in place (same object, same parameters), or for an
    mpu's model-parallel linear a new compression layer holding the same Parameters."""
    if isinstance(module, _COMPRESS_TYPES):
        return module
    if mpu is not None and isinstance(module, mp_linear_types(mpu)):
        return _convert_model_parallel(module, mpu)
    for plain, compress in COMPRESS_CLASSES:
        if type(module) is plain:
            module.__class__ = compress
            if hasattr(module, "init_compression_state"):
                module.init_compression_state()
            return module
    raise TypeError(f"{type(module).__name__} cannot be compressed; compressible layers: "
                    f"{[t.__name__ for t in COMPRESSIBLE_TYPES]} (and an mpu's ColumnParallelLinear/RowParallelLinear)")


def _convert_in_model(model: nn.Module, module_name: str, mpu: Any) -> nn.Module:
    old = recursive_getattr(model, module_name)
    new = convert_module(old, mpu)
    if new is not old:  # a model-parallel linear's compression layer replaces it in its parent
        recursive_setattr(model, module_name, new)
    return new


_ENABLERS = {"weight_quantization": "enable_weight_quantization",
             "activation_quantization": "enable_activation_quantization",
             "sparse_pruning": "enable_sparse_pruning", "row_pruning": "enable_row_pruning",
             "head_pruning": "enable_head_pruning", "channel_pruning": "enable_channel_pruning"}


def _configure(module: nn.Module, technique: str, p: dict[str, Any]) -> None:
    """Call the layer's ``enable_*`` for ``technique`` with the merged group parameters ``p``."""
    enable = getattr(module, _ENABLERS[technique], None)
    if enable is None:
        raise ValueError(f"{technique} does not apply to {type(module).__name__} layers (row/head pruning: Linear; "
                         "channel pruning: Conv2d; activation quantization and sparse pruning: Linear, Conv2d; "
                         "weight quantization: Linear, Conv2d, Embedding)")
    if technique == "weight_quantization":
        enable(p["start_bits"], p["target_bits"], p["quantization_period"], p["quantize_weight_in_forward"],
               p["quantization_type"], p["quantize_groups"], p["rounding"])
    elif technique == "activation_quantization":
        enable(p["bits"], p["quantization_type"], p["range_calibration"])
    elif technique == "head_pruning":
        enable(p["dense_ratio"], p["method"], p["num_heads"])
    else:
        enable(p["dense_ratio"], p["method"])


def module_replacement(model: nn.Module, module_name: str, compression_technique: dict[str, dict] | None = None,
                       mpu: Any = None) -> None:
    """Convert ``model.<module_name>`` to its compression class and configure ``compression_technique``
    (``{technique: merged parameters}``, only enabled ones take effect)."""
    module = _convert_in_model(model, module_name, mpu)
    for technique, params in (compression_technique or {}).items():
        if params.get("enabled"):
            _configure(module, technique, params)


def compression_preparation(model: nn.Module, compression_techinique_list: list, mpu: Any) -> nn.Module:
    """Convert every module a technique names and configure it. ``compression_techinique_list`` holds
    ``[module_name_lists, related_module_name_lists, {technique: params}]`` items (see ``get_compress_methods``);
    related modules are converted too, so ``redundancy_clean`` can shrink them."""
    for module_name_lists, related_lists, technique in compression_techinique_list:
        for names in module_name_lists:
            for module_name in names:
                module_replacement(model, module_name, technique, mpu=mpu)
        for per_module in related_lists:
            for names in per_module:
                for module_name in names:
                    _convert_in_model(model, module_name, mpu)
    return model


_FIXERS = {"weight_quantization": "fix_weight_quantization", "sparse_pruning": "fix_sparse_pruning_helper",
           "row_pruning": "fix_row_col_pruning_helper", "head_pruning": "fix_head_pruning_helper",
           "channel_pruning": "fix_channel_pruning_helper"}
"""Technique -> the layer method that bakes it in (activation quantization has none: it stays active)."""


def fix_compression(model: nn.Module, module_name: str, compression_technique: dict[str, dict],
                    mask: torch.Tensor | None = None, dim_reduction: bool = False) -> torch.Tensor | None:
    """Bake ``compression_technique`` into ``model.<module_name>``; for structured pruning return the kept mask
    (or, given the previous layer's ``mask``, shrink this related module's matching dimension)."""
    module = recursive_getattr(model, module_name)
    for technique, p in compression_technique.items():
        method = _FIXERS.get(technique)
        if method is None or not (p.get("enabled") or mask is not None):
            continue
        fixer = getattr(module, method, None)
        if fixer is None:
            raise ValueError(f"{technique}: module {module_name!r} ({type(module).__name__}) cannot take part; "
                             "row/head pruning and their related modules are Linear layers, channel pruning "
                             "Conv2d layers with Conv2d or BatchNorm2d related modules")
        if technique in ("weight_quantization", "sparse_pruning"):
            return fixer()
        if technique == "head_pruning":
            return fixer(mask, p.get("num_heads"), dim_reduction=dim_reduction)
        return fixer(mask, dim_reduction=dim_reduction)
    return None


def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Replace every ``convert_type`` module (GPT-2's ``Conv1D``: weight ``(in, out)``) with an equivalent
    ``nn.Linear``, so compression can reach it."""
    c_model = getattr(model, "module", model)
    for name, old in list(c_model.named_modules()):
        if isinstance(old, convert_type):
            n_in, n_out = old.weight.shape
            new = nn.Linear(n_in, n_out, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
            with torch.no_grad():
                new.weight.copy_(old.weight.t())
                if old.bias is not None:
                    new.bias.copy_(old.bias.reshape(-1))
            recursive_setattr(c_model, name, new)
    return model

"""The universal-checkpoint description each AutoTP parameter carries (DeepSpeed's format).

A sharded layer sets the attribute :data:`DS_AUTOTP_UC_META` on its parameters: the top-level keys say how to
cut this rank's shard out of a full tensor at restore (``logical_shape``, ``partition_dim``, ``partition_sizes``,
``sub_param_sizes``, ``sub_param_shard_widths``, ...); the nested ``conversion`` dict is the part a converter
needs, aggregated into a checkpoint's ``universal_checkpoint_info`` by ``deepspeed.module_inject.layers.
collect_autotp_universal_checkpoint_info``. The key strings and the version are file-format facts shared with
``deepspeed.checkpoint.constants`` (a test checks they agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

DS_AUTOTP_UC_META = "ds_autotp_universal_checkpoint_meta"
UC_VERSION_KEY = "universal_checkpoint_version"
UC_VERSION = 0.4  # the first version that records sub_param_shard_widths


def _tuple(value: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return tuple(value) if value is not None else None


def build_conversion_meta(*, partition_type: str, partition_dim: int | None = None,
                          sub_param_shape: Sequence[Any] | None = None,
                          sub_param_shard_widths: Sequence[Sequence[int]] | None = None,
                          original_shape: Sequence[int] | None = None, is_bias: bool = False,
                          replicated: bool = False, unsupported_reason: str | None = None) -> dict[str, Any]:
    """What conversion needs of one parameter (no restore-only details)."""
    return {"partition_type": partition_type, "partition_dim": partition_dim,
            "sub_param_shape": _tuple(sub_param_shape), "sub_param_shard_widths": sub_param_shard_widths,
            "original_shape": _tuple(original_shape), "is_bias": is_bias, "replicated": replicated,
            "unsupported_reason": unsupported_reason}


def build_restore_meta(*, partition_type: str, partition_dim: int | None = None,
                       logical_shape: Sequence[int] | None = None, output_shape: Sequence[int] | None = None,
                       sub_param_shape: Sequence[Any] | None = None, sub_param_sizes: Sequence[int] | None = None,
                       sub_param_shard_widths: Sequence[Sequence[int]] | None = None,
                       partition_sizes: Sequence[int] | None = None,
                       target_partition_shape: Sequence[int] | None = None,
                       original_shape: Sequence[int] | None = None, is_bias: bool = False, replicated: bool = False,
                       unsupported_reason: str | None = None) -> dict[str, Any]:
    """The full per-parameter description: restore fields (shapes as tuples) plus the nested ``conversion``."""
    return {UC_VERSION_KEY: UC_VERSION, "partition_type": partition_type, "partition_dim": partition_dim,
            "logical_shape": _tuple(logical_shape), "output_shape": _tuple(output_shape),
            "sub_param_shape": _tuple(sub_param_shape), "sub_param_sizes": _tuple(sub_param_sizes),
            "sub_param_shard_widths": sub_param_shard_widths, "partition_sizes": _tuple(partition_sizes),
            "target_partition_shape": _tuple(target_partition_shape), "original_shape": _tuple(original_shape),
            "is_bias": is_bias, "replicated": replicated,
            "conversion": build_conversion_meta(
                partition_type=partition_type, partition_dim=partition_dim, sub_param_shape=sub_param_shape,
                sub_param_shard_widths=sub_param_shard_widths, original_shape=original_shape, is_bias=is_bias,
                replicated=replicated, unsupported_reason=unsupported_reason)}


def set_uc_meta(param: torch.Tensor | None, **fields: Any) -> None:
    """Attach :func:`build_restore_meta` of ``fields`` to ``param`` (nothing for a missing parameter)."""
    if param is not None:
        setattr(param, DS_AUTOTP_UC_META, build_restore_meta(**fields))


def conversion_meta(param: torch.Tensor) -> dict[str, Any] | None:
    """The ``conversion`` view of a parameter's description, or None without one."""
    meta = getattr(param, DS_AUTOTP_UC_META, None)
    return meta.get("conversion") if meta else None


def shape_before_zero3(param: torch.Tensor | None) -> tuple[int, ...] | None:
    """The parameter's shape before ZeRO-3 emptied it (``ds_shape``), else its shape."""
    if param is None:
        return None
    ds_shape = getattr(param, "ds_shape", None)
    return tuple(param.shape) if ds_shape is None else tuple(ds_shape)

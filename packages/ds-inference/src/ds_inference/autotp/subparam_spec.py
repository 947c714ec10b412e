"""Reading DeepSpeed's sub-parameter view spec (``shape=`` of ``SubParamLinearLayer`` and ``TPLayerSpec``).

``shape`` views a ``[out, in]`` weight as a logical tensor whose last entry is the input width: ``-1`` is
inferred from the element count, and the entry at ``partition_dim`` is either ``-1`` (one block), a count
``n`` (``n`` equal sub-parameters) or a tuple of sub-parameter widths (``((q, k, v), -1)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SubParamView:
    """The resolved view: ``logical`` shape, its output part (``logical[:-1]``, the bias's view), the sub-parameter
    sizes along ``partition_dim`` (None: one block) and the bias's partition dimension (None: replicated)."""

    logical: tuple[int, ...]
    output: tuple[int, ...]
    sizes: tuple[int, ...] | None
    bias_dim: int | None


def _normalize(shape: Any) -> Any:
    if isinstance(shape, list):
        return tuple(_normalize(item) for item in shape)
    if isinstance(shape, tuple):
        return tuple(_normalize(item) if isinstance(item, list) else item for item in shape)
    return shape


def _partition_entry(entry: Any, label: str) -> tuple[tuple[int, ...] | None, int | None, int | None]:
    """(explicit sizes, count, known size) of the spec's entry at the partition dimension."""
    if isinstance(entry, tuple):
        if not entry or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in entry):
            raise ValueError(f"{label}: sub-parameter sizes {entry!r}; accepted: a non-empty tuple of positive ints")
        return tuple(entry), None, sum(entry)
    if isinstance(entry, int) and not isinstance(entry, bool) and (entry == -1 or entry > 0):
        return None, (entry if entry > 0 else None), None
    raise ValueError(f"{label}: partition_dim entry {entry!r}; accepted: a positive int (count), -1 or a tuple")


def parse_subparam_view(weight_shape: Sequence[int], shape: Any, partition_dim: int,
                        name: str | None = None) -> SubParamView:
    """Resolve ``shape`` against a weight of ``weight_shape``; every inconsistency is a ``ValueError``."""
    label = f"AutoTP layer '{name}'" if name else "AutoTP layer"
    shape = _normalize(shape)
    if not isinstance(shape, tuple):
        raise ValueError(f"{label}: shape={shape!r}; accepted: a tuple (lists are read as tuples)")
    if not isinstance(partition_dim, int) or not 0 <= partition_dim < len(shape):
        raise ValueError(f"{label}: partition_dim={partition_dim!r}; accepted: 0..{len(shape) - 1}")
    sizes, count, known = _partition_entry(shape[partition_dim], label)
    dims: list[int | None] = []
    for idx, dim in enumerate(shape):
        if idx == partition_dim:
            dims.append(known)
        elif isinstance(dim, int) and not isinstance(dim, bool) and (dim == -1 or dim > 0):
            dims.append(None if dim == -1 else dim)
        else:
            raise ValueError(f"{label}: shape entry {dim!r} at {idx}; accepted: a positive int or -1 (a tuple only "
                             f"at partition_dim={partition_dim})")
    total = math.prod(weight_shape)
    unknown = [i for i, d in enumerate(dims) if d is None]
    known_product = math.prod(d for d in dims if d is not None)
    if len(unknown) == 1:
        if total % known_product:
            raise ValueError(f"{label}: shape {shape} cannot view a weight of {total} elements")
        dims[unknown[0]] = total // known_product
    elif len(unknown) > 1 and len(shape) == len(weight_shape):
        for i in unknown:
            dims[i] = weight_shape[i]
    elif unknown:
        raise ValueError(f"{label}: shape {shape} has several inferred (-1) dimensions")
    logical = tuple(int(d) for d in dims)  # type: ignore[arg-type]
    if math.prod(logical) != total or logical[-1] != weight_shape[-1]:
        raise ValueError(f"{label}: shape {shape} resolves to {logical}; accepted: {total} elements ending in the "
                         f"weight's input width {weight_shape[-1]}")
    output = logical[:-1]
    if not output or math.prod(output) != weight_shape[0]:
        raise ValueError(f"{label}: the output part {output} of shape {shape} does not make {weight_shape[0]} rows")
    if count is not None:
        if logical[partition_dim] % count:
            raise ValueError(f"{label}: dimension {partition_dim} of {logical[partition_dim]} does not split into "
                             f"{count} equal sub-parameters")
        sizes = (logical[partition_dim] // count,) * count
    return SubParamView(logical, output, sizes, partition_dim if partition_dim < len(output) else None)

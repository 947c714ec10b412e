"""Config-dict helpers of the Autotuner: merging, tuning-space expansion, experiment names, number formatting."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any


def replace_dict(target: dict, update: Mapping | None, ignored_keys: tuple[str, ...] = ()) -> dict:
    """Overwrite ``target`` with ``update`` recursively (nested dicts merge); a ``None`` value deletes the key.

    Returns ``target``. Keys in ``ignored_keys`` (top level and below) are left alone.
    """
    for key, value in (update or {}).items():
        if key in ignored_keys:
            continue
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping):
            sub = target.get(key)
            target[key] = replace_dict(sub if isinstance(sub, dict) else {}, value, ignored_keys)
        else:
            target[key] = copy.deepcopy(value)
    return target


def get_val_by_key(d: Mapping, key: str) -> Any:
    """The value of ``key`` anywhere in nested ``d`` (first found, depth first), else ``None``."""
    if key in d:
        return d[key]
    for value in d.values():
        if isinstance(value, Mapping):
            found = get_val_by_key(value, key)
            if found is not None:
                return found
    return None


def set_val_by_key(d: MutableMapping, k: str, vv: Any) -> None:
    """Set key ``k`` to ``vv`` everywhere it occurs in nested ``d`` (every level, every branch; the sibling of
    :func:`get_val_by_key`, which reads the first occurrence). A key found nowhere is not added."""
    if k in d:
        d[k] = vv
    for sub in d.values():
        if isinstance(sub, MutableMapping):
            set_val_by_key(sub, k, vv)


def flatten(d: Mapping, parent_key: str = "", sep: str = "_") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a_b": 1}``."""
    items: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{parent_key}{sep}{key}" if parent_key else key
        if isinstance(value, Mapping):
            items.update(flatten(value, name, sep))
        else:
            items[name] = value
    return items


VALUE_LISTS = ("optimizer", "scheduler")
"""Sections whose lists are values (``betas``), never sets of candidates."""


def get_tuning_keys(space: Mapping, ignore_keys: tuple[str, ...] = VALUE_LISTS) -> list[str]:
    """Leaf keys whose value is a list of candidates (the tuning parameters of ``space``)."""
    keys: list[str] = []
    for key, value in space.items():
        if key in ignore_keys:
            continue
        if isinstance(value, Mapping):
            keys.extend(get_tuning_keys(value, ignore_keys))
        elif isinstance(value, list):
            keys.append(key)
    return keys


def gen_combinations(space: Mapping) -> Iterator[dict]:
    """Every config of ``space``: one value picked from each list (the cartesian product, nested dicts too)."""
    keys = list(space)
    choices = [list(gen_combinations(v)) if isinstance(v, Mapping) else (v if isinstance(v, list) else [v])
               for v in space.values()]
    for combo in itertools.product(*choices):
        yield dict(zip(keys, combo, strict=True))


def get_all_configs(space: Mapping, ignore_keys: tuple[str, ...] = VALUE_LISTS) -> list[dict]:
    """The distinct configs of ``space``; values under ``ignore_keys`` (e.g. an optimizer's ``betas`` list)
    are kept as given, not expanded."""
    kept = {k: space[k] for k in ignore_keys if k in space}
    tunable = {k: v for k, v in space.items() if k not in kept}
    out: list[dict] = []
    for combo in gen_combinations(tunable):
        config = {**copy.deepcopy(kept), **combo}
        if config not in out:
            out.append(config)
    return out


_SHORT = {"train_micro_batch_size_per_gpu": "mbs", "gradient_accumulation_steps": "gas",
          "reduce_bucket_size": "rbs", "allgather_bucket_size": "abs", "overlap_comm": "oc",
          "reduce_scatter": "rs", "contiguous_gradients": "cg", "allgather_partitions": "ap"}


def canonical_name(config: Mapping, tuning_keys: list[str], prefix: str = "", omit_val: bool = False) -> str:
    """A file-system safe experiment name from the values of ``tuning_keys`` in ``config``
    (e.g. ``z2_oc1_rbs5e+08_mbs4``); ``omit_val`` names the space instead (``z2_oc_rbs_mbs``)."""
    flat = dict(_leaves(config))
    parts = []
    for key in tuning_keys:
        short = _SHORT.get(key, "".join(w[0] for w in key.split("_")))
        if omit_val:
            parts.append(short)
        else:
            value = flat.get(key)
            parts.append(f"{short}{_fmt(value)}")
    return prefix + "_".join(parts)


def _leaves(d: Mapping) -> Iterator[tuple[str, Any]]:
    for key, value in d.items():
        if isinstance(value, Mapping):
            yield from _leaves(value)
        else:
            yield key, value


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float) and (value >= 1e5 or value != int(value)):
        return f"{value:.0e}"
    if isinstance(value, float):
        return str(int(value))
    return str(value)


def number_to_string(num: float, precision: int = 2) -> str:
    """``1.2 M`` style (K/M/B/T)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(num) >= scale:
            return f"{num / scale:.{precision}f} {unit}"
    return f"{num:.{precision}f}"


def memory_to_string(num: float, postfix: str = "B", precision: int = 2) -> str:
    """``1.50 GB`` style (powers of 1024)."""
    for unit, scale in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(num) >= scale:
            return f"{num / scale:.{precision}f} {unit}{postfix}"
    return f"{num:.{precision}f} {postfix}"


def tuning_micro_batch_sizes(min_mbs: int, max_mbs: int, num: int, max_train_batch_size_per_gpu: int) -> list[int]:
    """The micro-batch sizes tried between ``min_mbs`` and ``max_mbs`` (DeepSpeed's rule).

    The range starts at ``max_mbs // 2`` at the lowest (smaller sizes only add accumulation steps), is cut into
    ``num`` equal strides, and a size whose gradient accumulation steps equal those of ``max_mbs`` is dropped:
    with the same number of steps the larger size does the same work in fewer, larger kernels.
    """
    if min_mbs <= 0 or max_mbs <= 0:
        return []
    low = max(min_mbs, max_mbs // 2)
    stride = max((max_mbs - low) // max(num, 1), 1)
    min_gas = max_train_batch_size_per_gpu // max_mbs
    sizes = [mbs for mbs in range(low, max_mbs, stride) if max_train_batch_size_per_gpu // mbs != min_gas]
    return sizes + [max_mbs]


def instantiation_memory_per_gpu(num_params: int, stage: int, total_gpus: int, mp_size: int,
                                 fp16: bool) -> float:
    """Bytes per rank for parameters, gradients and Adam states at ZeRO ``stage`` (DeepSpeed's estimate:
    2|4 bytes of weights, 2|4 of gradients, 16|8 of optimizer states per parameter, fp16|fp32)."""
    params = num_params * (2 if fp16 else 4)
    grads = num_params * (2 if fp16 else 4)
    optim = num_params * (16 if fp16 else 8)
    if stage >= 1:
        optim /= total_gpus
    if stage >= 2:
        grads /= total_gpus
    if stage >= 3:
        params /= total_gpus
    return (params + grads + optim) / mp_size


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

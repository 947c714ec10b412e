"""Elastic batch sizes: one global batch size that stays valid over a range of GPU counts.

Served as ``deepspeed.elasticity`` / ``deepspeed.elasticity.elasticity``. Candidates are ``base x highly
composite number`` (the most divisors, hence the most GPU counts that divide them), the largest such product not
above ``max_train_batch_size``, for every micro batch and their LCM as base; the candidate valid for the most GPU
counts in ``[min_gpus, max_gpus]`` wins (ties go to the larger batch with ``prefer_larger_batch``, else the
smaller). Version 0.2 runs the same search over whole nodes of data-parallel ranks, so that model parallelism
stays inside a node; a world size off its list gets a batch size of its own. Pure arithmetic, as DeepSpeed's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from ds_config.batch import BatchSizes
from ds_config.elastic_constants import (
    DEEPSPEED_ELASTICITY_CONFIG,
    ELASTICITY,
    ENABLED,
    ENABLED_DEFAULT,
    LATEST_ELASTICITY_VERSION,
    MINIMUM_DEEPSPEED_VERSION,
    VERSION,
)
from ds_config.elasticity import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)

logger = logging.getLogger(__name__)

# Highly composite numbers (OEIS A002182): each has more divisors than every smaller number; enough for 720K.
HCN_LIST = HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
    20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
    665280, 720720)


@dataclass(frozen=True)
class ElasticPlan:
    """The elastic global batch size and the (data-parallel) world sizes it supports."""

    train_batch_size: int
    valid_world_sizes: tuple[int, ...]


def get_candidate_batch_sizes(base_list: list[int], max_acceptable_batch_size: int) -> list[int]:
    """For each base not above the cap: the largest ``base * HCN`` not above it."""
    out = set()
    for base in base_list:
        if base > max_acceptable_batch_size:
            continue  # scaling only grows it
        if base == max_acceptable_batch_size:
            out.add(base)
        else:
            value = max_acceptable_batch_size // base
            out.add(max(h for h in HCN_LIST if h <= value) * base)
    return sorted(out)


def get_valid_gpus(batch_size: int, micro_batches: list[int], min_valid_gpus: int, max_valid_gpus: int) -> list[int]:
    """GPU counts in ``[min, max]`` that split ``batch_size`` into whole micro batches of one of the sizes."""
    valid = set()
    for micro in micro_batches:
        if batch_size % micro == 0:
            most = batch_size // micro  # one micro batch per GPU per step; fewer GPUs accumulate
            valid.update(n for n in range(max(min_valid_gpus, 1), min(max_valid_gpus, most) + 1) if most % n == 0)
    return sorted(valid)


def get_best_candidates(candidate_batch_sizes: list[int], micro_batches: list[int], min_gpus: int, max_gpus: int,
                        prefer_larger: bool) -> tuple[int, list[int] | None]:
    """The candidate valid for the most GPU counts (ties: larger or smaller batch) and those counts."""
    max_valid, valid_gpus, final = 0, None, int(min(micro_batches))
    for batch in candidate_batch_sizes:
        current = get_valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        if len(current) > max_valid or (len(current) == max_valid and (
                (prefer_larger and batch > final) or (not prefer_larger and batch < final))):
            max_valid, valid_gpus, final = len(current), current, batch
    return final, valid_gpus


def _get_compatible_gpus_v01(micro_batches: list[int], max_acceptable_batch_size: int, min_gpus: int | None = None,
                             max_gpus: int | None = None, prefer_larger: bool = True) -> tuple[int, list[int] | None]:
    """v0.1: bases are each micro batch and their LCM; returns (batch size, valid GPU counts)."""
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    if not all(mb <= max_acceptable_batch_size for mb in micro_batches):
        raise ElasticityConfigError(f"All micro batches {micro_batches} must be less than or equal to "
                                    f"max_acceptable_batch_size: {max_acceptable_batch_size}")
    bases = [*micro_batches, math.lcm(*micro_batches)]
    candidates = get_candidate_batch_sizes(bases, max_acceptable_batch_size)
    return get_best_candidates(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def _microbatch_for(micro_batches: list[int], batch: int, dp_world: int, prefer_larger: bool) -> int | None:
    per_rank = batch // dp_world
    fits = [m for m in micro_batches if per_rank % m == 0]
    if not fits:
        return None
    return max(fits) if prefer_larger else fits[0]


def _get_compatible_gpus_v02(micro_batches: list[int], max_acceptable_batch_size: int, current_num_gpus: int,
                             min_gpus: int | None = None, max_gpus: int | None = None, prefer_larger: bool = True,
                             num_gpus_per_node: int = 1,
                             model_parallel_size: int = 1) -> tuple[int, list[int], int | None]:
    """v0.2: the v0.1 search over nodes; returns (batch size, valid data-parallel sizes, micro batch).

    ``current_num_gpus`` counts every GPU (data x model parallel). A world size off the node-level list gets a
    batch of its own: the largest (or smallest) ``floor(max / (micro * dp)) * micro * dp`` over the micro batches.
    """
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(f"In Elasticity v0.2, number of GPUs per node: {num_gpus_per_node} should be "
                              f"divisible by model parallel size {model_parallel_size}",
                              "elasticity.model_parallel_size")
    dp_per_node = num_gpus_per_node // model_parallel_size
    batch, valid_nodes = _get_compatible_gpus_v01(
        micro_batches, int(max_acceptable_batch_size / dp_per_node), int(min_gpus / num_gpus_per_node),
        int(max_gpus / num_gpus_per_node), prefer_larger=prefer_larger)
    if valid_nodes is None:  # DeepSpeed fails here with a TypeError
        raise ElasticityConfigError(f"no batch size up to max_train_batch_size ({max_acceptable_batch_size}) made of "
                                    f"micro batches {micro_batches} fits any node count in [{min_gpus}, {max_gpus}] "
                                    f"GPUs / {num_gpus_per_node} per node")
    batch = int(batch) * dp_per_node
    valid_dp = [n * dp_per_node for n in valid_nodes]
    if current_num_gpus // model_parallel_size in valid_dp:
        dp = current_num_gpus // model_parallel_size
        return batch, valid_dp, _microbatch_for(micro_batches, batch, dp, prefer_larger)
    current_dp = (current_num_gpus / num_gpus_per_node) * dp_per_node
    sizes = [math.floor(max_acceptable_batch_size / float(m * current_dp)) * m * current_dp for m in micro_batches]
    chosen = max(sizes) if prefer_larger else min(sizes)
    if chosen < 1:  # DeepSpeed would train with a global batch of 0
        raise ElasticityIncompatibleWorldSize(f"World size ({current_num_gpus}) is off the valid list {valid_dp} and "
                                              f"no batch of micro batches {micro_batches} per data-parallel rank fits "
                                              f"max_train_batch_size ({max_acceptable_batch_size})")
    return chosen, [int(current_dp)], _microbatch_for(micro_batches, chosen, int(current_dp), prefer_larger)


def _release(version: str) -> tuple[tuple[int, ...], bool]:
    """(release numbers, is a pre/dev release) of a PEP 440 version string."""
    match = re.fullmatch(r"\s*v?(\d+(?:\.\d+)*)((?:[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview|dev)\d*)*)"
                         r"((?:[-_.]?(?:post|rev|r)\d*)*)(\+[a-z0-9.]+)?\s*", str(version), re.IGNORECASE)
    if not match:
        raise ElasticityError(f"Invalid target deepspeed version: {version!r}")
    numbers = tuple(int(x) for x in match.group(1).split("."))
    while numbers and numbers[-1] == 0:
        numbers = numbers[:-1]
    return numbers, bool(match.group(2))


def _compatible_ds_version_check(target_deepspeed_version: str) -> bool:
    """Raise ``ElasticityError`` when the target version predates elasticity (``MINIMUM_DEEPSPEED_VERSION``)."""
    target, pre = _release(target_deepspeed_version)
    minimum, _ = _release(MINIMUM_DEEPSPEED_VERSION)
    if target < minimum or (target == minimum and pre):
        raise ElasticityError(f"Target deepspeed version of {target_deepspeed_version} is not compatible with "
                              f"minimum version {MINIMUM_DEEPSPEED_VERSION} supporting elasticity.")
    return True


def elasticity_enabled(ds_config: dict) -> bool:
    """Whether ``ds_config`` (a dict) enables elastic training."""
    if ELASTICITY not in ds_config:
        return False
    return bool(ds_config[ELASTICITY].get(ENABLED, ENABLED_DEFAULT))


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict) -> None:
    """Check that the resource scheduler (``DEEPSPEED_ELASTICITY_CONFIG``) saw the same elastic config."""
    if DEEPSPEED_ELASTICITY_CONFIG not in os.environ:
        logger.warning("Unable to find DEEPSPEED_ELASTICITY_CONFIG environment variable, cannot guarantee "
                       "resource scheduler will scale this job using compatible GPU counts.")
        return
    scheduler = ElasticityConfig(json.loads(os.environ[DEEPSPEED_ELASTICITY_CONFIG]))
    runtime = ElasticityConfig(runtime_elastic_config_dict)
    for name in ("max_acceptable_batch_size", "micro_batches", "version"):
        if getattr(runtime, name) != getattr(scheduler, name):
            raise ElasticityConfigError(f"Elastic config '{name}={getattr(scheduler, name)}' seen by resource "
                                        f"scheduler does not match config passed to runtime "
                                        f"{name}={getattr(runtime, name)}")


def _env_world_size(version: float) -> int:
    value = os.getenv("WORLD_SIZE")
    if value is not None and value.isnumeric():
        return int(value)
    raise ElasticityConfigError(f"Elasticity V {version} needs WORLD_SIZE to compute a valid batch size. Either give "
                                "it as argument to function compute_elastic_config or set it as an environment "
                                f"variable. Value of WORLD_SIZE as environment variable is {value}")


def _pick_microbatch(cfg: ElasticityConfig, batch: int, world_size: int, valid: list[int]) -> int:
    """Largest micro batch dividing the per-rank share of ``batch`` at ``world_size`` (which must be valid)."""
    if not valid or world_size not in valid:
        raise ElasticityIncompatibleWorldSize(f"World size ({world_size}) is not valid with the current list of "
                                              f"valid GPU counts: {valid}")
    for micro in sorted(set(cfg.micro_batches), reverse=True):
        if batch // world_size % micro == 0:
            return micro
    raise ElasticityError(f"Unable to find divisible micro batch size world_size={world_size}, "
                          f"final_batch_size={batch}, and micro_batches={cfg.micro_batches}.")


def _compute(cfg: ElasticityConfig, world_size: int, return_microbatch: bool) -> tuple[Any, ...]:
    """``compute_elastic_config`` on a validated section (no version check)."""
    micro, version = cfg.micro_batches, float(cfg.version)
    if cfg.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"Elasticity V{cfg.version} does not support model-parallel training. Given "
                                    f"model-parallel size: {cfg.model_parallel_size}", "elasticity.version")
    candidate_micro = None
    if version == 0.1:
        batch, valid = _get_compatible_gpus_v01(micro, cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus,
                                                cfg.prefer_larger_batch)
    else:
        current = world_size if world_size != 0 else _env_world_size(cfg.version)
        batch, valid, candidate_micro = _get_compatible_gpus_v02(
            micro, cfg.max_train_batch_size, current, cfg.min_gpus, cfg.max_gpus, cfg.prefer_larger_batch,
            cfg.num_gpus_per_node, cfg.model_parallel_size)
    batch = int(batch)
    logger.info("Valid World Size (GPUs / Model Parallel Size): %s", valid)
    if world_size > 0:
        return batch, valid, _pick_microbatch(cfg, batch, world_size, valid)
    if not return_microbatch:
        return batch, valid
    if version == 0.2:
        return batch, valid, candidate_micro
    return batch, valid, _pick_microbatch(cfg, batch, _env_world_size(cfg.version), valid)


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple[Any, ...]:
    """DeepSpeed's elasticity API: ``(train_batch_size, valid GPU counts[, micro batch])`` for ``ds_config``.

    The same config always gives the same answer, so a scheduler and every rank agree. With ``world_size`` > 0
    (the data-parallel size) it must be in the valid list (else ``ElasticityIncompatibleWorldSize``) and the
    largest micro batch that divides the per-rank share comes back too. Version 0.2 needs a world size (argument
    or ``WORLD_SIZE``). Raises ``ElasticityConfigError`` for a missing, disabled or invalid section and
    ``ElasticityError`` when ``target_deepspeed_version`` predates elasticity.
    """
    if not isinstance(ds_config, dict):
        raise ValueError(f"Expected ds_config to be a dictionary but received a {type(ds_config)}, "
                         f"containing: {ds_config}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(f"'{ELASTICITY}' is missing from config json, please add it if running an "
                                    "elastic training job.")
    section = ds_config[ELASTICITY]
    if not section.get(ENABLED, ENABLED_DEFAULT):
        raise ElasticityConfigError("Elasticity is disabled, please enable it ('enabled':true) if running an "
                                    "elastic training job.")
    version = section.get(VERSION)
    if isinstance(version, (int, float)) and not isinstance(version, bool) and version > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"Attempting to run elasticity version {version} but runtime only supports up "
                                    f"to {LATEST_ELASTICITY_VERSION}", "elasticity.version")
    cfg = ElasticityConfig(section)
    _compatible_ds_version_check(target_deepspeed_version)
    return _compute(cfg, world_size, return_microbatch)


def elastic_plan(cfg: ElasticityConfig, world_size: int | None = None) -> ElasticPlan:
    """The elastic batch size for ``cfg`` and the data-parallel world sizes it runs on.

    Version 0.2 needs the data-parallel ``world_size`` (its answer may depend on it); without one it uses the
    first node-level size.
    """
    if float(cfg.version) == 0.1:
        batch, valid = _compute(cfg, 0, False)
        return ElasticPlan(batch, tuple(valid or ()))
    per_node = cfg.num_gpus_per_node // cfg.model_parallel_size if not \
        cfg.num_gpus_per_node % cfg.model_parallel_size else 1
    dp = world_size if world_size else per_node * max(int(cfg.min_gpus / cfg.num_gpus_per_node), 1)
    batch, valid, _ = _get_v02(cfg, dp)
    return ElasticPlan(int(batch), tuple(valid))


def _get_v02(cfg: ElasticityConfig, dp_world: int) -> tuple[int, list[int], int | None]:
    return _get_compatible_gpus_v02(cfg.micro_batches, cfg.max_train_batch_size, dp_world * cfg.model_parallel_size,
                                    cfg.min_gpus, cfg.max_gpus, cfg.prefer_larger_batch, cfg.num_gpus_per_node,
                                    cfg.model_parallel_size)


def elastic_batch_sizes(cfg: ElasticityConfig, world_size: int) -> BatchSizes:
    """Batch keys for ``world_size`` data-parallel ranks under elastic training (as DeepSpeed's runtime config).

    ``gradient_accumulation_steps = train_batch_size // (micro batch * world_size)``. Version 0.2 counts every GPU
    as ``world_size * model_parallel_size``.
    """
    if float(cfg.version) == 0.1:
        batch, valid, micro = _compute(cfg, world_size, True)
    else:
        batch, valid, _ = _get_v02(cfg, world_size)
        micro = _pick_microbatch(cfg, int(batch), world_size, valid)
    batch = int(batch)
    return BatchSizes(batch, micro, batch // (micro * world_size), world_size)

"""Elastic batch sizes: one global batch size that stays valid over a range of GPU counts.

With ``elasticity`` enabled the batch keys come from here: candidates are ``micro batch x highly composite
number`` (highly composite numbers have the most divisors, hence the most GPU counts that divide them) below
``max_train_batch_size``; the candidate valid for the most GPU counts in ``[min_gpus, max_gpus]`` wins (ties go
to the larger batch when ``prefer_larger_batch``). Version 0.2 counts whole nodes of data-parallel ranks so
that model parallelism stays inside a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ds_config._errors import ConfigError, ConfigProblem
from ds_config.batch import BatchSizes
from ds_config.elasticity import ElasticityConfig

# Highly composite numbers (OEIS A002182): each has more divisors than every smaller number.
HIGHLY_COMPOSITE = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
                    10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200,
                    332640, 498960, 554400, 665280, 720720)


@dataclass(frozen=True)
class ElasticPlan:
    """The elastic global batch size and the data-parallel sizes it supports."""

    train_batch_size: int
    valid_world_sizes: tuple[int, ...]


def _largest_hcn_at_most(value: int) -> int:
    return max(h for h in HIGHLY_COMPOSITE if h <= value)


def _candidates(micro_batches: list[int], max_batch: int) -> list[int]:
    bases = [*micro_batches, math.lcm(*micro_batches)]
    return sorted({b if b >= max_batch else _largest_hcn_at_most(max_batch // b) * b for b in bases})


def _valid_world_sizes(batch: int, micro_batches: list[int], low: int, high: int) -> list[int]:
    sizes = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        most = batch // micro  # every rank runs one micro batch per step; fewer ranks accumulate
        sizes.update(n for n in range(max(low, 1), min(high, most) + 1) if most % n == 0)
    return sorted(sizes)


def _best(micro_batches: list[int], max_batch: int, low: int, high: int, prefer_larger: bool) -> ElasticPlan:
    plans = [ElasticPlan(b, tuple(_valid_world_sizes(b, micro_batches, low, high)))
             for b in _candidates(micro_batches, max_batch)]
    # most supported world sizes first; among equals the larger (or smaller) batch
    return max(plans, key=lambda p: (len(p.valid_world_sizes), p.train_batch_size if prefer_larger
                                     else -p.train_batch_size))


def elastic_plan(cfg: ElasticityConfig) -> ElasticPlan:
    """The elastic batch size for ``cfg`` and the data-parallel world sizes it runs on."""
    micro = sorted(set(cfg.micro_batch_sizes))
    if cfg.version == 0.1:
        return _best(micro, cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus, cfg.prefer_larger_batch)
    if cfg.num_gpus_per_node % cfg.model_parallel_size:
        raise ConfigError(ConfigProblem("elasticity.model_parallel_size", f"must divide num_gpus_per_node "
                                        f"({cfg.num_gpus_per_node}) so model-parallel groups stay in a node",
                                        cfg.model_parallel_size))
    per_node = cfg.num_gpus_per_node // cfg.model_parallel_size  # data-parallel ranks per node
    nodes = _best(micro, max(cfg.max_train_batch_size // per_node, 1), max(cfg.min_gpus // cfg.num_gpus_per_node, 1),
                  max(cfg.max_gpus // cfg.num_gpus_per_node, 1), cfg.prefer_larger_batch)
    return ElasticPlan(nodes.train_batch_size * per_node, tuple(n * per_node for n in nodes.valid_world_sizes))


def elastic_batch_sizes(cfg: ElasticityConfig, world_size: int) -> BatchSizes:
    """Batch keys for ``world_size`` data-parallel ranks under elastic training (largest fitting micro batch)."""
    plan = elastic_plan(cfg)
    if world_size not in plan.valid_world_sizes:
        raise ConfigError(ConfigProblem("elasticity", f"data-parallel world size {world_size} is not one the "
                                        f"elastic batch size {plan.train_batch_size} supports: "
                                        f"{list(plan.valid_world_sizes)}"))
    per_rank = plan.train_batch_size // world_size
    micro = max(m for m in cfg.micro_batch_sizes if per_rank % m == 0)
    return BatchSizes(plan.train_batch_size, micro, per_rank // micro, world_size)

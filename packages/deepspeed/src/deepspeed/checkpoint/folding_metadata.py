"""The ``folding`` entry a checkpoint of AutoEP folded onto AutoTP carries in each file (DeepSpeed's
``make_folding_metadata`` / ``validate_folding_metadata``, served from ``deepspeed.checkpoint.autoep_universal``).

It records the layout the file was written under (tensor- and expert-parallel sizes and ranks, the ZeRO partition
group of the file's parameters, their family: ``dense``, ``routed_expert``, ``zero_optimizer_state``) so that a
load under another layout fails with the difference named instead of silently mixing shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepspeed.checkpoint.constants import (
    FOLDING_DISPATCH_STRATEGY,
    FOLDING_EP_RANK,
    FOLDING_EP_SIZE,
    FOLDING_ETP_RANK,
    FOLDING_ETP_SIZE,
    FOLDING_FAMILY,
    FOLDING_METADATA_KEY,
    FOLDING_METADATA_VERSION,
    FOLDING_PARAM_FAMILIES,
    FOLDING_SHARED_EXPERT_PLACEMENT,
    FOLDING_TP_RANK,
    FOLDING_TP_SIZE,
    FOLDING_ZERO_PARTITION_COUNT,
    FOLDING_ZERO_PARTITION_GROUP,
    FOLDING_ZERO_PARTITION_RANK,
)

# the folded forward routes every assignment once (split over the TP peers) and shards the shared experts by TP
DISPATCH_STRATEGY = "route_full_partition_dispatch"
SHARED_EXPERT_PLACEMENT = "tp_sharded"


def make_folding_metadata(*, tp_size: int, tp_rank: int, ep_size: int, ep_rank: int, zero_partition_group: str,
                          zero_partition_rank: int, zero_partition_count: int, family: str,
                          param_families: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``folding`` entry of one saved file (expert tensor parallelism is always 1 here)."""
    entry = {"version": FOLDING_METADATA_VERSION, FOLDING_TP_SIZE: tp_size, FOLDING_TP_RANK: tp_rank,
             FOLDING_EP_SIZE: ep_size, FOLDING_EP_RANK: ep_rank, FOLDING_ETP_SIZE: 1, FOLDING_ETP_RANK: 0,
             FOLDING_ZERO_PARTITION_GROUP: zero_partition_group, FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
             FOLDING_ZERO_PARTITION_COUNT: zero_partition_count, FOLDING_DISPATCH_STRATEGY: DISPATCH_STRATEGY,
             FOLDING_SHARED_EXPERT_PLACEMENT: SHARED_EXPERT_PLACEMENT, FOLDING_FAMILY: family}
    if param_families is not None:
        entry[FOLDING_PARAM_FAMILIES] = dict(param_families)
    return entry


def validate_folding_metadata(metadata: Any, *, tp_size: int, ep_size: int, etp_size: int = 1,
                              tp_rank: int | None = None, ep_rank: int | None = None, etp_rank: int | None = None,
                              zero_partition_group: str | None = None, zero_partition_rank: int | None = None,
                              zero_partition_count: int | None = None, family: str | None = None,
                              param_families: Mapping[str, Any] | None = None,
                              shared_expert_placement: str | None = None,
                              dispatch_strategy: str | None = None) -> dict[str, Any]:
    """The ``folding`` entry of a loaded file (``metadata``: the file's dict), checked against the run: the sizes
    always, every other field the caller gives. ``RuntimeError`` naming the field, the saved and the run's value."""
    if not isinstance(metadata, Mapping) or FOLDING_METADATA_KEY not in metadata:
        raise RuntimeError("Missing AutoEP+AutoTP folding metadata in folded checkpoint: the file has no "
                           f"'{FOLDING_METADATA_KEY}' entry (saved by an unfolded run, or by another tool)")
    folding = metadata[FOLDING_METADATA_KEY]
    if not isinstance(folding, Mapping) or folding.get("version") != FOLDING_METADATA_VERSION:
        version = folding.get("version") if isinstance(folding, Mapping) else folding
        raise RuntimeError(f"Unsupported AutoEP+AutoTP folding metadata version {version!r}; this version reads "
                           f"{FOLDING_METADATA_VERSION}")
    wanted = {FOLDING_TP_SIZE: tp_size, FOLDING_EP_SIZE: ep_size, FOLDING_ETP_SIZE: etp_size,
              FOLDING_TP_RANK: tp_rank, FOLDING_EP_RANK: ep_rank, FOLDING_ETP_RANK: etp_rank,
              FOLDING_ZERO_PARTITION_GROUP: zero_partition_group, FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
              FOLDING_ZERO_PARTITION_COUNT: zero_partition_count, FOLDING_FAMILY: family,
              FOLDING_PARAM_FAMILIES: None if param_families is None else dict(param_families),
              FOLDING_SHARED_EXPERT_PLACEMENT: shared_expert_placement, FOLDING_DISPATCH_STRATEGY: dispatch_strategy}
    for key, value in wanted.items():
        if value is not None and folding.get(key) != value:
            raise RuntimeError(f"AutoEP+AutoTP folding metadata mismatch for {key}: saved={folding.get(key)!r}, "
                               f"this run={value!r}")
    return dict(folding)

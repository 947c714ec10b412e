"""``aio`` section: Linux native asynchronous I/O used for NVMe offload."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from ds_config._base import DSConfigModel
from ds_config._types import Bool, PosInt


class AioConfig(DSConfigModel):
    """``aio``: libaio settings for offloading parameters and optimizer states to NVMe."""

    block_size: PosInt = 1048576
    """I/O block size in bytes."""
    queue_depth: PosInt = 8
    """I/O queue depth."""
    thread_count: PosInt = Field(1, validation_alias=AliasChoices("thread_count", "intra_op_parallelism"))
    """Threads per I/O request (newer DeepSpeed spells it ``intra_op_parallelism``)."""
    single_submit: Bool = False
    """Submit requests one at a time instead of as one batch."""
    overlap_events: Bool = True
    """Submit requests without waiting for earlier ones to complete."""
    use_gds: Bool = False
    """Use NVIDIA GPUDirect Storage."""

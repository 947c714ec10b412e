"""``activation_checkpointing`` section."""

from __future__ import annotations

from ds_config._base import DSConfigModel
from ds_config._types import Bool, PosInt


class ActivationCheckpointingConfig(DSConfigModel):
    """``activation_checkpointing``: memory optimisations of checkpointed activations."""

    partition_activations: Bool = False
    """Partition checkpointed activations across model-parallel ranks."""
    cpu_checkpointing: Bool = False
    """Offload partitioned activations to CPU (with ``partition_activations``)."""
    contiguous_memory_optimization: Bool = False
    """Copy partitioned activations into one contiguous buffer."""
    number_checkpoints: PosInt | None = None
    """Number of activation checkpoints, used to size the contiguous buffer."""
    synchronize_checkpoint_boundary: Bool = False
    """Call ``torch.cuda.synchronize()`` at each checkpoint boundary."""
    profile: Bool = False
    """Log forward and backward time of each checkpointed function."""

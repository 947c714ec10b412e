"""Adam optimizers (``deepspeed.ops.adam``): native CPU Adam and torch-fused FusedAdam."""

from ds_ops.adam.cpu_adam import DeepSpeedCPUAdam
from ds_ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

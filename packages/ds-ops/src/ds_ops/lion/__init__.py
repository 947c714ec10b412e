"""Lion optimizers (``deepspeed.ops.lion``): native CPU Lion and multi-tensor FusedLion."""

from ds_ops.lion.cpu_lion import DeepSpeedCPULion
from ds_ops.lion.fused_lion import FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]

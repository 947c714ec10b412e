"""Adam optimizers (``deepspeed.ops.adam``): native CPU Adam, torch-fused FusedAdam and ZenFlow's selective AdamW."""

from ds_ops.adam.cpu_adam import DeepSpeedCPUAdam
from ds_ops.adam.fused_adam import FusedAdam
from ds_ops.adam.zenflow_adam import ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]

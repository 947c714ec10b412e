"""ZenFlow's ZeRO-side pieces (``deepspeed.runtime.zenflow``): the stage 1/2 optimizer wrapper, its schedule and
column selection, and the core split. The selective AdamW is ``ds_ops.adam`` and the config section
``ds_config.zero.ZenFlowConfig``."""

from ds_zero.zenflow.cores import split_affinity
from ds_zero.zenflow.optimizer import ZenFlowZeroOptimizer
from ds_zero.zenflow.plan import ZenFlowPlan

__all__ = ["ZenFlowPlan", "ZenFlowZeroOptimizer", "split_affinity"]

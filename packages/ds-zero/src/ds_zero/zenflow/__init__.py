"""ZenFlow's ZeRO-side pieces (``deepspeed.runtime.zenflow``); the selective optimizer is ``ds_ops.adam``
and the config section ``ds_config.zero.ZenFlowConfig``."""

from ds_zero.zenflow.cores import split_affinity

__all__ = ["split_affinity"]

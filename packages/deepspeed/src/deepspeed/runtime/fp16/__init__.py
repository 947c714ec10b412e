"""``deepspeed.runtime.fp16``: fp16 training helpers; ``loss_scaler`` holds DeepSpeed's loss scalers."""

from deepspeed.compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes, as in DeepSpeed

"""Random layerwise token dropping (random-LTD, https://arxiv.org/abs/2211.11586)."""

from deepspeed.compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)

"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` section (ds-config) and
its defaults under DeepSpeed's module path."""

from ds_config.zero import DEFAULT_LEAF_MODULE_CLASSES as _CLASSES
from ds_config.zero import DeepSpeedZeroLeafModuleConfig

DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
           "DeepSpeedZeroLeafModuleConfig"]

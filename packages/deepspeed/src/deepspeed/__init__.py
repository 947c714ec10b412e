"""DeepSpeed, modular: the meta-package.

Serves the documented DeepSpeed API and every documented module path (see ``deepspeed._compat_paths``)
from the component packages (ds_config, ds_ops, ds_zero, ...).
"""

from deepspeed import _compat
from deepspeed.__about__ import __version__

_compat.install()

__all__ = ["__version__"]

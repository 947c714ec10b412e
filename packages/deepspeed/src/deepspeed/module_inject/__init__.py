"""``deepspeed.module_inject``: only AutoEP's layer is served here (``auto_ep_layer``, from ``ds_moe.autoep``).

Kernel injection and AutoTP (``replace_transformer_layer``, ``set_autotp_mode``, ...) are not built: their
submodules raise ``FeatureNotAvailable`` and their names an ``AttributeError``, each naming the feature.
"""

from typing import Any

from deepspeed._compat import not_built_message, submodule_getattr
from deepspeed._compat_paths import NOT_BUILT

_submodule = submodule_getattr(__name__)


def __getattr__(name: str) -> Any:
    try:
        return _submodule(name)
    except AttributeError:
        if name.startswith("__"):
            raise
        raise AttributeError(not_built_message(f"deepspeed.module_inject.{name}", NOT_BUILT[__name__])) from None

"""``deepspeed.ops``: DeepSpeed's op packages (served from ds_ops through ``deepspeed._compat_paths``) and
``__compatible_ops__`` (the same dict as ``deepspeed.git_version_info.compatible_ops``), computed on first access."""

from typing import Any

from deepspeed.compat import submodule_getattr

_submodule = submodule_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name == "__compatible_ops__":
        from deepspeed.git_version_info import compatible_ops

        return compatible_ops
    return _submodule(name)

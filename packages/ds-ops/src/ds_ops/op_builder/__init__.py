"""Build system for ds-ops' native code (``deepspeed.ops.op_builder``).

Each op is an :class:`OpBuilder`: ``CPUAdamBuilder().load()`` returns the loaded library, compiling it
on first use (torch.utils.cpp_extension + ninja) into ``$DS_OPS_CACHE_DIR`` under a file lock, or
using the copy prebuilt at install time (``DS_BUILD_OPS=1``).

Other subpackages add builders without this package knowing them: a module listed in ``_PLUGINS``
exposes the builder class at its top level (``ds_ops.aio.AsyncIOBuilder``), which needs a ``NAME`` and
``is_compatible(verbose=False)`` (``compatibility_problems()``/``is_built()`` are shown when present);
``from ds_ops.op_builder import AsyncIOBuilder`` imports that module on first access and registers the
class, and :func:`all_builders` (used by ``ds_report``) does the same for every plugin.

The fused optimizers run on torch's own kernels, so their builders (``FusedAdamBuilder``, ...; see
``torch_ops``) compile nothing and ``load()`` returns the op's module. :func:`op_tables` gives DeepSpeed's
``installed_ops`` / ``compatible_ops`` (``deepspeed.git_version_info``) from the same registry.
"""

from __future__ import annotations

import importlib
from typing import Any

from ds_ops.op_builder._builder import CACHE_ENV, OpBuilder, OpBuildError, cache_root
from ds_ops.op_builder._cpu import (
    SIMD_ENV,
    SIMD_LEVELS,
    best_simd_level,
    cpu_features,
    cpu_model,
    supported_simd_levels,
)
from ds_ops.op_builder.builder import CUDAOpBuilder
from ds_ops.op_builder.builders import BandwidthProbeBuilder, CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder
from ds_ops.op_builder.evoformer_attn import EvoformerAttnBuilder
from ds_ops.op_builder.kernel_builders import NOT_BUILT_BUILDERS, TORCH_BUILDERS, NotBuiltOpBuilder
from ds_ops.op_builder.torch_ops import FusedAdamBuilder, FusedLambBuilder, FusedLionBuilder, TorchOpBuilder

# Builder class name -> module that defines it and registers it on import.
_PLUGINS: dict[str, str] = {"AsyncIOBuilder": "ds_ops.aio", "PinMemoryBuilder": "ds_ops.aio"}

ALL_OPS: dict[str, type] = {}


def register_builder(cls: type) -> type:
    """Add a builder class to ALL_OPS (keyed by its ``NAME``) and to this module's namespace."""
    name = getattr(cls, "NAME", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_builder({cls!r}): the class needs a non-empty str NAME attribute")
    ALL_OPS[name] = cls
    globals()[cls.__name__] = cls
    return cls


for _cls in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder, FusedLambBuilder, FusedLionBuilder,
             EvoformerAttnBuilder, *TORCH_BUILDERS, *NOT_BUILT_BUILDERS):  # the last two: kernel_builders
    register_builder(_cls)


def all_builders() -> tuple[dict[str, type], dict[str, str]]:
    """Registered builders after importing every plugin module, and {plugin: error} for those that failed."""
    errors = {}
    for cls_name, module in _PLUGINS.items():
        try:
            if cls_name not in globals():
                register_builder(getattr(importlib.import_module(module), cls_name))
        except Exception as exc:  # a broken plugin must not hide the other ops from the report
            errors[cls_name] = f"{type(exc).__name__}: {exc}"
    return dict(ALL_OPS), errors


def is_installed(builder: Any) -> bool:
    """DeepSpeed's ``installed_ops`` meaning: the op loads without compiling anything.

    A native op counts when the wheel ships its library for this CPU (``DS_BUILD_OPS=1`` at install; a JIT-cache
    build does not count, as in DeepSpeed). Ops without native code (async_io over cffi's ABI mode, the fused
    optimizers on torch's kernels) are installed with the package. CUDA ops are never prebuilt in this version.
    """
    if isinstance(builder, (NotBuiltOpBuilder, CUDAOpBuilder)):
        return False
    return not isinstance(builder, OpBuilder) or builder.prebuilt_path() is not None


def op_tables() -> tuple[dict[str, bool], dict[str, bool]]:
    """``(installed_ops, compatible_ops)``: {op NAME: bool} over every registered builder, as ``ds_report`` sees them.

    ``compatible_ops`` is ``is_compatible()`` (a native op is compatible when it is built or buildable here) and
    keeps DeepSpeed's ``"deepspeed_not_implemented": False`` entry. A builder that cannot even be constructed
    here (say a bad ``DS_OPS_SIMD``) is neither.
    """
    installed, compatible = {}, {}
    for name, cls in sorted(all_builders()[0].items()):
        try:
            builder = cls()
            installed[name], compatible[name] = is_installed(builder), bool(builder.is_compatible())
        except Exception:  # noqa: BLE001 - ds_report shows the reason; here the op is simply unusable
            installed[name] = compatible[name] = False
    compatible["deepspeed_not_implemented"] = False
    return installed, compatible


def __getattr__(name: str) -> Any:
    if name in _PLUGINS:
        module = importlib.import_module(_PLUGINS[name])
        if name not in globals():
            register_builder(getattr(module, name))
        return globals()[name]
    raise AttributeError(f"module 'ds_ops.op_builder' has no attribute {name!r}")


__all__ = [
    "ALL_OPS",
    "BandwidthProbeBuilder",
    "CACHE_ENV",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "CUDAOpBuilder",
    "EvoformerAttnBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
    "NotBuiltOpBuilder",
    "OpBuildError",
    "OpBuilder",
    "SIMD_ENV",
    "SIMD_LEVELS",
    "TorchOpBuilder",
    *(c.__name__ for c in TORCH_BUILDERS + NOT_BUILT_BUILDERS),
    "all_builders",
    "best_simd_level",
    "cache_root",
    "cpu_features",
    "cpu_model",
    "is_installed",
    "op_tables",
    "register_builder",
    "supported_simd_levels",
]

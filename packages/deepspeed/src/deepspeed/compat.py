"""Import hooks that serve ``COMPAT_PATHS``: ``import deepspeed.runtime.zero.config`` yields ``ds_config.zero``.

The aliased module object is the provider itself (not a copy), so classes keep one identity whichever
path a script imports them from. Intermediate packages of a documented path that have no real module
(``deepspeed.runtime.zero`` before ZeRO's own modules exist) are served as empty namespace packages.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from deepspeed._compat_paths import COMPAT_PATHS, NOT_BUILT


class FeatureNotAvailable(ModuleNotFoundError):
    """A documented DeepSpeed module path whose feature this version does not provide yet."""


def not_built_message(what: str, feature: str) -> str:
    return (f"{what} is part of {feature}, which this version of the modular DeepSpeed does not provide yet; "
            "see the README's 'What works today' for what does")


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.provider_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.provider_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamps the alias spec onto the module; the provider keeps its own identity
        # so find_spec/reload of the provider's real name keep working.
        module.__spec__ = self.provider_spec


def submodule_getattr(package: str) -> Callable[[str], Any]:
    """A package's ``__getattr__`` that imports ``package.<name>`` on first attribute access.

    DeepSpeed's ``__init__`` files import their submodules eagerly, so callers reach them as attributes
    without importing them (Accelerate reads ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` after a
    bare ``import deepspeed``). Ours stay lazy, to keep ``import deepspeed`` free of torch.
    """

    def __getattr__(name: str) -> Any:
        if name.isidentifier() and not name.startswith("__"):  # a child's name, never a dotted path
            try:
                return importlib.import_module(f"{package}.{name}")
            except FeatureNotAvailable as exc:  # hasattr() stays False, and a direct access says why
                raise AttributeError(str(exc)) from None
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":  # the submodule exists but needs something missing
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


class _PrefixLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, f"Documented DeepSpeed namespace {spec.name}.")
        module.__path__ = []
        module.__getattr__ = submodule_getattr(spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the package only holds its documented submodules."""


class AliasFinder(importlib.abc.MetaPathFinder):
    """Placed first on ``sys.meta_path``: documented paths resolve to their provider module."""

    def __init__(self, table: Mapping[str, str]) -> None:
        self.table = table

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None):
        provider = self._provider(fullname)
        if provider is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(provider))

    def _provider(self, fullname: str) -> str | None:
        """The table row, or for a submodule of an aliased package the provider's own submodule.

        Without the second case ``deepspeed.ops.aio._handle`` would be found on the provider's path and run
        a second time under the alias name, giving its classes two identities.
        """
        if fullname in self.table:
            return self.table[fullname]
        parts = fullname.split(".")
        for cut in range(len(parts) - 1, 1, -1):
            row = self.table.get(".".join(parts[:cut]))
            if row is not None:
                candidate = ".".join([row, *parts[cut:]])
                try:
                    found = importlib.util.find_spec(candidate)
                except ModuleNotFoundError:  # the provider row is a module, not a package
                    found = None
                return candidate if found is not None else None
        return None


class PrefixFinder(importlib.abc.MetaPathFinder):
    """Placed last on ``sys.meta_path``: parents of documented paths that no real module provides."""

    def __init__(self, table: Mapping[str, str]) -> None:
        self.prefixes = {name.rsplit(".", i)[0] for name in table for i in range(1, name.count("."))}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None):
        if fullname not in self.prefixes:
            return None
        return importlib.machinery.ModuleSpec(fullname, _PrefixLoader(), is_package=True)


class _NotBuiltLoader(importlib.abc.Loader):
    def __init__(self, feature: str) -> None:
        self.feature = feature

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        raise FeatureNotAvailable(not_built_message(f"module {spec.name!r}", self.feature), name=spec.name)

    def exec_module(self, module: types.ModuleType) -> None:  # never reached: create_module raises
        raise FeatureNotAvailable(module.__name__, name=module.__name__)


class NotBuiltFinder(importlib.abc.MetaPathFinder):
    """Placed last on ``sys.meta_path``: documented paths of features not built yet fail with an error naming the
    feature (only when no real module or alias provides the path)."""

    def __init__(self, table: Mapping[str, str]) -> None:
        self.table = table

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None):
        for prefix, feature in self.table.items():
            if fullname == prefix or fullname.startswith(prefix + "."):
                return importlib.machinery.ModuleSpec(fullname, _NotBuiltLoader(feature), is_package=True)
        return None


def install(table: Mapping[str, str] = COMPAT_PATHS, not_built: Mapping[str, str] = NOT_BUILT) -> None:
    """Register the finders once per process."""
    if any(isinstance(f, AliasFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, AliasFinder(table))
    sys.meta_path.append(PrefixFinder(table))
    sys.meta_path.append(NotBuiltFinder(not_built))

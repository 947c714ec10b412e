"""Import hooks that serve ``COMPAT_PATHS``: ``import deepspeed.runtime.zero.config`` yields ``ds_config.zero``.

The aliased module object is the provider itself (not a copy), so classes keep one identity whichever
path a script imports them from. Intermediate packages of a documented path that have no real module
(``deepspeed.runtime.zero`` before ZeRO's own modules exist) are served as empty namespace packages.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Mapping, Sequence

from deepspeed._compat_paths import COMPAT_PATHS


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        """The provider module was executed when it was imported."""


class _PrefixLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, f"Documented DeepSpeed namespace {spec.name}.")
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the package only holds its documented submodules."""


class AliasFinder(importlib.abc.MetaPathFinder):
    """Placed first on ``sys.meta_path``: documented paths resolve to their provider module."""

    def __init__(self, table: Mapping[str, str]) -> None:
        self.table = table

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None):
        provider = self.table.get(fullname)
        if provider is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(provider))
        return spec


class PrefixFinder(importlib.abc.MetaPathFinder):
    """Placed last on ``sys.meta_path``: parents of documented paths that no real module provides."""

    def __init__(self, table: Mapping[str, str]) -> None:
        self.prefixes = {name.rsplit(".", i)[0] for name in table for i in range(1, name.count("."))}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None):
        if fullname not in self.prefixes:
            return None
        return importlib.machinery.ModuleSpec(fullname, _PrefixLoader(), is_package=True)


def install(table: Mapping[str, str] = COMPAT_PATHS) -> None:
    """Register the finders once per process."""
    if any(isinstance(f, AliasFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, AliasFinder(table))
    sys.meta_path.append(PrefixFinder(table))

"""Load a helper file that sits next to a test file (a folder pytest imports in importlib mode, so not on
``sys.path``) once per process, under a fixed module name the multi-rank workers find again."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def load_sibling(test_file: str, file_name: str, module_name: str) -> types.ModuleType:
    """The module in ``file_name`` beside ``test_file``, registered in ``sys.modules`` as ``module_name``."""
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, Path(test_file).with_name(file_name))
        sys.modules[module_name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module_name])
    return sys.modules[module_name]

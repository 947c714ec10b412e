"""Hatch build hook: ``DS_BUILD_OPS=1 pip install --no-build-isolation packages/ds-ops`` compiles the
native ops into the wheel (``ds_ops/_prebuilt``); without the variable the wheel stays pure Python and
each op is compiled on first use (JIT). torch and ninja must be importable in the build environment,
hence ``--no-build-isolation`` (an isolated build would download torch).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class OpsBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        sys.path.insert(0, str(Path(self.root, "src")))
        try:
            from ds_ops.op_builder._prebuild import prebuild, selected_ops
        except ImportError as exc:
            if not any(k.startswith("DS_BUILD_") for k in os.environ):
                return
            raise RuntimeError(
                f"DS_BUILD_* is set but ds_ops' builder cannot be imported ({exc}); torch and ninja must be "
                "installed in the build environment: pip install --no-build-isolation packages/ds-ops"
            ) from exc
        finally:
            sys.path.pop(0)
        builders = selected_ops(os.environ)
        if not builders:
            return
        if version == "editable":
            prebuild(Path(self.root, "src", "ds_ops", "_prebuilt"), builders)
            return
        self._tmp = tempfile.mkdtemp(prefix="ds_ops_wheel_")
        for path in prebuild(Path(self._tmp), builders):
            build_data["force_include"][str(path)] = f"ds_ops/_prebuilt/{path.name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

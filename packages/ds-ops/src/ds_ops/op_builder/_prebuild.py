"""Ahead-of-time build of the native ops into a directory the wheel ships as ``ds_ops/_prebuilt``.

Selection follows DeepSpeed's variables: ``DS_BUILD_OPS=1`` builds every op, ``DS_BUILD_<OP>=1``
(``DS_BUILD_CPU_ADAM``, ``DS_BUILD_CPU_ADAGRAD``, ``DS_BUILD_CPU_LION``) one op, and ``DS_BUILD_<OP>=0``
leaves one out of ``DS_BUILD_OPS=1``. Each library is stored as ``<op>-<simd level>.so`` with a JSON
manifest whose content key the loader checks against the installed sources.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ds_ops.op_builder._builder import OpBuilder
from ds_ops.op_builder.builders import CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder

PREBUILDABLE: tuple[type[OpBuilder], ...] = (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder)


def _flag(env: Mapping[str, str], key: str) -> bool | None:
    value = env.get(key)
    if value is None or value.strip() == "":
        return None
    if value.strip() not in ("0", "1"):
        raise ValueError(f"{key}={value!r} is invalid; expected 0 or 1")
    return value.strip() == "1"


def selected_ops(env: Mapping[str, str]) -> list[type[OpBuilder]]:
    """The builders the environment asks to prebuild (empty: a pure-Python wheel that JIT-builds)."""
    build_all = _flag(env, "DS_BUILD_OPS")
    chosen = []
    for cls in PREBUILDABLE:
        own = _flag(env, f"DS_BUILD_{cls.NAME.upper()}")
        if own or (own is None and build_all):
            chosen.append(cls)
    return chosen


def prebuild(dest: Path, builders: list[type[OpBuilder]], simd_level: str | None = None) -> list[Path]:
    """Compile each op into ``dest`` as ``<op>-<level>.so`` plus manifest; returns every file written."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="ds_ops_aot_") as tmp:
        for cls in builders:
            builder = cls(simd_level)
            lib = builder.build_into(Path(tmp, builder.NAME))
            target = dest / f"{builder.NAME}-{builder.simd_level}.so"
            shutil.copy2(lib, target)
            manifest = target.with_suffix(".json")
            manifest.write_text(json.dumps({"name": builder.NAME, "simd_level": builder.simd_level,
                                            "content_key": builder.content_key()}, indent=1))
            written += [target, manifest]
    return written

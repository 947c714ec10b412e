"""``ds_report`` / ``python -m ds_ops.report``: environment and native-op status, one line per fact.

Shows torch (version, build, CUDA), the compiler and ninja, the CPU's SIMD levels, the JIT cache, and
for each op whether it is compatible here, already built (prebuilt in the wheel or in the JIT cache)
or buildable on first use.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

import torch

from ds_ops import __version__
from ds_ops.op_builder import (
    CACHE_ENV,
    SIMD_ENV,
    all_builders,
    best_simd_level,
    cache_root,
    cpu_model,
    supported_simd_levels,
    toolchain,
)

_OK, _NO = "[OKAY]", "[NO]"


def _deepspeed_version() -> str:
    """The DeepSpeed API version the installed meta-package serves (ds-ops cannot import it: read its metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "not installed (ds-ops alone)"


def environment_lines() -> list[tuple[str, str]]:
    """(label, value) pairs describing torch, CUDA, the toolchain and the CPU."""
    cxx = toolchain.compiler_path()
    ninja = toolchain.ninja_path()
    cuda = torch.cuda.is_available()
    return [
        ("deepspeed version", _deepspeed_version()),
        ("ds-ops version", __version__),
        ("torch version", torch.__version__),
        ("torch install path", os.path.dirname(torch.__file__)),
        ("torch build", f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"),
        ("CUDA available", f"yes ({torch.cuda.device_count()} device(s))" if cuda else "no"),
        ("C++ compiler", f"{cxx} ({toolchain.compiler_version(cxx)})" if cxx else f"{_NO} {toolchain.compiler()} "
         "not found"),
        ("ninja", ninja or f"{_NO} not found (pip install ninja)"),
        ("CPU", cpu_model()),
        ("CPU SIMD levels", ", ".join(supported_simd_levels())),
        ("build SIMD level", _build_level()),
        ("OpenMP threads (torch)", str(torch.get_num_threads())),
        ("JIT cache", f"{cache_root()}" + (f" (from {CACHE_ENV})" if os.environ.get(CACHE_ENV) else "")),
    ]


def _build_level() -> str:
    try:
        level = best_simd_level()
    except ValueError as exc:
        return f"{_NO} {exc}"
    return level + (f" (forced by {SIMD_ENV})" if os.environ.get(SIMD_ENV) else "")


def op_rows() -> list[tuple[str, str, str, str]]:
    """(op, compatible, built, note) for every registered builder, plugins included."""
    builders, plugin_errors = all_builders()
    rows = []
    for name, cls in sorted(builders.items()):
        try:
            builder = cls()
            problems = builder.compatibility_problems() if hasattr(builder, "compatibility_problems") else (
                [] if builder.is_compatible() else ["not compatible"])
            built = builder.is_built() if hasattr(builder, "is_built") else "n/a"
        except Exception as exc:  # one broken builder must not hide the others
            rows.append((name, _NO, "-", f"{type(exc).__name__}: {exc}"))
            continue
        if problems:
            note = " ".join(problems)
        elif built == "n/a":
            note = "nothing to compile"
        else:
            note = "loads now" if built else "builds on first use (JIT)"
        rows.append((name, _NO if problems else _OK, built or "no", note))
    for cls_name, error in sorted(plugin_errors.items()):
        rows.append((cls_name, _NO, "-", f"plugin import failed: {error}"))
    return rows


def render(out: TextIO) -> None:
    """Write the whole report to ``out``."""
    env = environment_lines()
    width = max(len(k) for k, _ in env)
    out.write("ds-ops environment\n" + "-" * 60 + "\n")
    for key, value in env:
        out.write(f"{key:<{width}} : {value}\n")
    rows = op_rows()
    out.write("\n" + f"{'op name':<18}{'compatible':<12}{'built':<10}note\n" + "-" * 60 + "\n")
    for name, compatible, built, note in rows:
        out.write(f"{name:<18}{compatible:<12}{built:<10}{note}\n")


def main(argv: list[str] | None = None) -> int:
    """Console entry point; exit status 0 (the report is informational)."""
    argparse.ArgumentParser(prog="ds_report", description=__doc__.splitlines()[0]).parse_args(argv)
    render(sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

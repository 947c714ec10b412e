"""Checks that a native op can be compiled here, each failure phrased as what is missing and how to fix it."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_PROBE = """
#include <omp.h>
#include <cstdint>
#if DS_SIMD_LEVEL >= 1
#include <immintrin.h>
#endif
extern "C" int probe(float* x, int64_t n) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) x[i] *= 2.0f;
  return omp_get_max_threads();
}
"""


def compiler() -> str:
    """The C++ compiler torch.utils.cpp_extension will use (``CXX``, default ``c++``)."""
    return os.environ.get("CXX", "c++")


def compiler_path() -> str | None:
    return shutil.which(compiler())


@functools.lru_cache(maxsize=4)
def compiler_version(path: str) -> str:
    """First line of ``<compiler> --version``."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "unknown"


def compiler_identity() -> str:
    """Cheap fingerprint of the compiler binary (path, size, mtime) for the cache key: no subprocess."""
    path = compiler_path()
    if path is None:
        return "missing"
    st = Path(path).resolve().stat()
    return f"{Path(path).resolve()}:{st.st_size}:{st.st_mtime_ns}"


def ninja_path() -> str | None:
    """The ninja executable (the pip ``ninja`` package puts one next to the interpreter)."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return None
    return shutil.which("ninja") or "ninja"


def toolchain_problems() -> list[str]:
    """What is missing to compile any op (empty when a compiler and ninja are present)."""
    problems = []
    if compiler_path() is None:
        problems.append(
            f"no C++ compiler: {compiler()!r} is not on PATH. Install one (Debian/Ubuntu: apt-get install g++) "
            "or point CXX at it."
        )
    if ninja_path() is None:
        problems.append("ninja is not installed: pip install ninja (or apt-get install ninja-build).")
    return problems


@functools.lru_cache(maxsize=8)
def probe_compile(flags: tuple[str, ...]) -> str | None:
    """Compile a tiny OpenMP/intrinsics file with ``flags``; None when it works, else why it failed."""
    path = compiler_path()
    if path is None:
        return f"no C++ compiler {compiler()!r}"
    with tempfile.TemporaryDirectory(prefix="ds_ops_probe_") as tmp:
        src = Path(tmp, "probe.cpp")
        src.write_text(_PROBE)
        cmd = [path, *flags, "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(Path(tmp, "probe.so"))]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"running {path} failed: {exc}"
    if out.returncode == 0:
        return None
    tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-6:])
    return (
        f"{path} cannot compile OpenMP code with {' '.join(flags)}:\n{tail}\n"
        "Install the compiler's OpenMP headers/runtime (Debian/Ubuntu: apt-get install g++ libgomp1), "
        "or build a narrower instruction set with DS_OPS_SIMD=avx2 or DS_OPS_SIMD=scalar."
    )

"""CPU feature detection: which SIMD level the native ops are compiled for, and the flags that select it."""

from __future__ import annotations

import functools
import os
import platform

SIMD_LEVELS = ("scalar", "avx2", "avx512")
SIMD_ENV = "DS_OPS_SIMD"

# Features each level's code uses; a CPU must have all of them.
_REQUIRED: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "scalar": frozenset(),
}
_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "scalar": (),
}


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """Feature flags of this CPU from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """Human-readable CPU model name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def supported_simd_levels() -> list[str]:
    """The levels this CPU can run, lowest first."""
    if not _is_x86():
        return ["scalar"]
    have = cpu_features()
    return [level for level in SIMD_LEVELS if _REQUIRED[level] <= have]


def missing_features(level: str) -> list[str]:
    """CPU features ``level`` needs that this CPU lacks."""
    if level != "scalar" and not _is_x86():
        return [f"an x86-64 CPU (this one is {platform.machine()})"]
    return sorted(_REQUIRED[level] - cpu_features())


def requested_simd_level() -> str | None:
    """The level forced through ``DS_OPS_SIMD``, validated; None when unset."""
    value = os.environ.get(SIMD_ENV, "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in SIMD_LEVELS:
        raise ValueError(f"{SIMD_ENV}={value!r} is not a SIMD level; accepted: auto, {', '.join(SIMD_LEVELS)}")
    return value


def best_simd_level() -> str:
    """``DS_OPS_SIMD`` when set, else the widest level this CPU supports."""
    return requested_simd_level() or supported_simd_levels()[-1]


def simd_flags(level: str) -> list[str]:
    """Compiler flags selecting ``level``'s instructions (the C++ side keys off -DDS_SIMD_LEVEL)."""
    if level not in _FLAGS:
        raise ValueError(f"simd level {level!r} is unknown; accepted: {', '.join(SIMD_LEVELS)}")
    return [*_FLAGS[level], f"-DDS_SIMD_LEVEL={SIMD_LEVELS.index(level)}"]


def simd_feature_key(level: str) -> str:
    """What a build for ``level`` assumes about the CPU, for the cache key."""
    return f"{platform.machine()}:{level}:{','.join(sorted(_REQUIRED[level]))}"

"""CUDA compute-capability lists for nvcc builds: parsing ``TORCH_CUDA_ARCH_LIST``, the default targets per CUDA
toolkit, and the ``-gencode`` flags a list compiles to.

An arch list in DeepSpeed's builder format is ``[[major, minor], ...]`` of strings, where the minor part may end
in ``+PTX`` (also embed PTX for that arch so newer GPUs can JIT it): ``"8.0+PTX"`` -> ``["8", "0+PTX"]``.
"""

from __future__ import annotations

import re

ArchList = list[list[str]]

_ENTRY = re.compile(r"^\d+\.\d+(\+PTX)?$")
# Targets every toolkit DeepSpeed supports can build; newer toolkits add theirs (default_compute_capabilities).
BASE_CAPABILITIES = ("6.0", "6.1", "7.0")
# CUDA 13 removed offline compilation for GPUs below Turing (sm_75).
_CUDA13_MIN = (7, 5)


def parse_arch_list(text: str, source: str = "TORCH_CUDA_ARCH_LIST") -> list[str]:
    """``"7.0 8.0;9.0+PTX"`` -> ``["7.0", "8.0", "9.0+PTX"]`` (``;`` or whitespace separated).

    ``source`` names where the text came from, for the error a malformed entry raises.
    """
    entries = [e.strip() for e in text.replace(" ", ";").split(";") if e.strip()]
    bad = [e for e in entries if not _ENTRY.match(e)]
    if bad:
        raise ValueError(f"{source}={text!r}: entries {bad} are not compute capabilities; each must be "
                         "MAJOR.MINOR with an optional +PTX suffix, e.g. '8.0;9.0+PTX'")
    return entries


def default_compute_capabilities(toolkit: tuple[int, int] | None) -> list[str]:
    """The targets a cross-compile builds when no arch list is given, for CUDA toolkit ``(major, minor)`` (None:
    no toolkit found, the base list)."""
    caps = list(BASE_CAPABILITIES)
    if toolkit is None:
        return caps
    major, minor = toolkit
    if major == 11:
        caps += ["8.0"] + (["8.6"] if minor >= 1 else []) + (["9.0"] if minor >= 8 else [])
    elif major >= 12:
        caps += ["8.0", "8.6", "9.0"] + (["10.0", "12.0"] if (major, minor) >= (12, 8) else [])
    if major >= 13:
        caps = [c for c in caps if tuple(int(p) for p in c.split(".")) >= _CUDA13_MIN]
    return caps


def split_archs(ccs: list[str]) -> ArchList:
    """``["8.0+PTX"]`` -> ``[["8", "0+PTX"]]`` (the format ``filter_ccs`` takes apart)."""
    return [cc.split(".") for cc in ccs]


def canonical_archs(archs: ArchList) -> list[tuple[int, int, bool]]:
    """Sorted ``(major, minor, ptx)`` with one entry per arch; ``ptx`` is set when any spelling of it asked for PTX
    (``8.0;8.0+PTX`` is one sm_80 build plus its PTX, as torch's own parser reads it)."""
    merged: dict[tuple[int, int], bool] = {}
    for major, minor in archs:
        key = (int(major), int(minor.split("+")[0]))
        merged[key] = merged.get(key, False) or minor.endswith("+PTX")
    return [(major, minor, ptx) for (major, minor), ptx in sorted(merged.items())]


def arch_list_string(archs: list[tuple[int, int, bool]]) -> str:
    """The ``TORCH_CUDA_ARCH_LIST`` value for canonical archs: ``"7.0;8.0+PTX"``."""
    return ";".join(f"{major}.{minor}{'+PTX' if ptx else ''}" for major, minor, ptx in archs)


def gencode_flags(archs: list[tuple[int, int, bool]]) -> list[str]:
    """nvcc flags: one SASS target per arch, plus its PTX where asked."""
    flags = []
    for major, minor, ptx in archs:
        num = f"{major}{minor}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags

"""Human-readable numbers for the printed profile: ``1.5 GMACs``, ``12.3 M`` params, ``4.2 ms``."""

from __future__ import annotations

_UNITS = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}


def _auto_unit(num: float) -> str:
    magnitude = abs(num)
    for unit in ("T", "G", "M", "K"):
        if magnitude >= _UNITS[unit]:
            return unit
    if magnitude >= 1 or magnitude == 0:
        return ""
    return "m" if magnitude >= 1e-3 else "u"


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """``num`` scaled to a metric prefix (T, G, M, K, '', m, u), e.g. ``number_to_string(2.5e9) == '2.5 G'``."""
    unit = _auto_unit(num) if units is None else units
    if unit not in _UNITS:
        raise ValueError(f"units={units!r} is not one of {sorted(_UNITS)}")
    return f"{round(num / _UNITS[unit], precision):g} {unit}"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    """Multiply-accumulate count, e.g. ``'3.14 GMACs'``."""
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    """Floating-point operations per second, e.g. ``'81.9 TFLOPS'``."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def bytes_to_string(num_bytes: float, units: str | None = None, precision: int = 2) -> str:
    """Byte count, e.g. ``'1.2 GB'``."""
    return f"{number_to_string(num_bytes, units, precision)}B"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    """Parameter count; billions are written ``B`` (``'1.3 B'``), as in model names."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = 2) -> str:
    """Duration given in seconds, e.g. ``'76.4 ms'``."""
    return f"{number_to_string(seconds, units, precision)}s"

"""Reusable constrained field types for config sections (no torch: dtypes are spelled as strings)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, StrictBool

from ds_config._base import KeepAuto

Auto = Literal["auto"]
Bool = StrictBool


def _integral(value: Any) -> Any:
    """JSON writers (and ``5e8`` literals) give floats for integer keys: accept them when they are whole."""
    if isinstance(value, bool):
        raise ValueError("expected an integer, not a boolean")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
PosInt = Annotated[int, BeforeValidator(_integral), Field(gt=0)]
NonNeg = Annotated[int, BeforeValidator(_integral), Field(ge=0)]


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


Float = Annotated[float, BeforeValidator(_no_bool), Field(allow_inf_nan=False)]

# Values that Hugging Face Transformers / Accelerate write as "auto" and fill in before the engine starts.
AutoPosInt = Annotated[PosInt | Auto, KeepAuto()]

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}


def _dtype_name(accepted: tuple[str, ...]):
    def check(value: Any) -> str:
        if not isinstance(value, str) or value.lower() not in _DTYPE_ALIASES:
            raise ValueError(f"unknown dtype; accepted: {', '.join(accepted)} (or float32/float16/bfloat16)")
        canon = _DTYPE_ALIASES[value.lower()]
        if canon not in accepted:
            raise ValueError(f"dtype {canon} is not accepted here; accepted: {', '.join(accepted)}")
        return canon
    return check


DType = Annotated[str, AfterValidator(_dtype_name(("fp32", "fp16", "bf16")))]
"""A floating dtype as ``"fp32" | "fp16" | "bf16"`` (torch-style names such as ``"bfloat16"`` are normalised)."""

LowDType = Annotated[str, AfterValidator(_dtype_name(("fp16", "bf16")))]


def torch_dtype_name(short: str) -> str:
    """``"bf16"`` -> ``"bfloat16"``: the dtype's attribute name in ``torch`` (the engine resolves it; this
    package does not import torch)."""
    return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[short]

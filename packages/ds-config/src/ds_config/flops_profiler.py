"""``flops_profiler`` section."""

from __future__ import annotations

from pydantic import Field

from ds_config._base import DSConfigModel
from ds_config._types import Bool, Float, Int, PosInt


class FlopsProfilerConfig(DSConfigModel):
    """``flops_profiler``: profile one training step's parameters, latency and FLOPs."""

    enabled: Bool = False
    """Enable the flops profiler."""
    recompute_fwd_factor: Float = Field(0.0, ge=0, le=1)
    """Fraction of the forward pass recomputed in backward (activation checkpointing), for the FLOPs count."""
    profile_step: PosInt = 1
    """Global training step at which to profile (warm-up steps make the timing accurate)."""
    module_depth: Int = Field(-1, ge=-1)
    """Depth of the aggregated per-module report; -1 means the innermost modules."""
    top_modules: PosInt = 3
    """Number of top modules shown in the aggregated profile."""
    detailed: Bool = True
    """Print the detailed per-module profile."""
    output_file: str | None = None
    """File to write the profile to; ``None`` prints to stdout."""

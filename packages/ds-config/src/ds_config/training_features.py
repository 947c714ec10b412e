"""Smaller training features with their own top-level section: ``eigenvalue`` and ``progressive_layer_drop``."""

from __future__ import annotations

from pydantic import Field

from ds_config._base import DSConfigModel
from ds_config._types import Bool, Float, NonNeg, PosInt


class EigenvalueConfig(DSConfigModel):
    """``eigenvalue``: power-iteration estimate of each block's Hessian eigenvalue (logged as
    ``Train/Eigenvalues/ModelBlockParam_{i}``; used by MoQ to schedule quantization)."""

    enabled: Bool = False
    """Compute eigenvalues."""
    verbose: Bool = False
    """Print the eigenvalues as they are computed."""
    max_iter: PosInt = 100
    """Most power iterations per estimate."""
    tol: Float = Field(1e-2, gt=0)
    """Relative change at which the power iteration stops."""
    stability: Float = Field(1e-6, ge=0)
    """Added to denominators for numerical stability."""
    gas_boundary_resolution: PosInt = 1
    """Compute every N gradient-accumulation boundaries."""
    layer_name: str = "bert.encoder.layer"
    """Name of the module list whose blocks are analysed."""
    layer_num: NonNeg = 0
    """Number of blocks in ``layer_name``."""


class ProgressiveLayerDropConfig(DSConfigModel):
    """``progressive_layer_drop``: skip transformer layers stochastically with a growing drop rate."""

    enabled: Bool = False
    """Enable progressive layer drop."""
    theta: Float = Field(0.5, ge=0, le=1)
    """Final keep probability (the schedule decays towards it; 0 drops every layer in the end)."""
    gamma: Float = Field(0.001, ge=0)
    """Decay rate of the keep probability per step (0 keeps every layer)."""

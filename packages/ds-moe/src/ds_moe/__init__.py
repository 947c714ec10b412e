"""Mixture of Experts: the MoE layer, top-k gating, expert parallelism over explicit process groups, and AutoEP."""

from ds_moe.__about__ import __version__

__all__ = ["__version__"]

"""The Zero Redundancy Optimizer: ZeRO stages 1-3 over torch."""

from ds_zero.__about__ import __version__

__all__ = ["__version__"]

"""Typed, validated schema of the whole DeepSpeed ds_config."""

from ds_config.__about__ import __version__

__all__ = ["__version__"]

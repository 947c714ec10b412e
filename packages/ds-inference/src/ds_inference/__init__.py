"""Inference: init_inference, the InferenceEngine, tensor-parallel inference and weight quantization."""

from ds_inference.__about__ import __version__

__all__ = ["__version__"]

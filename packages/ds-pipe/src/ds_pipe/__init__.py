"""Pipeline parallelism: ProcessTopology, PipelineModule/LayerSpec, the pipeline schedules and engine."""

from ds_pipe.__about__ import __version__

__all__ = ["__version__"]

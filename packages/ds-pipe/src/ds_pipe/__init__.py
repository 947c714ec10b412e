"""Pipeline parallelism: ProcessTopology, PipelineModule/LayerSpec/TiedLayerSpec, the pipeline schedules and the pipeline engine."""

from ds_pipe.__about__ import __version__

__all__ = ["__version__"]

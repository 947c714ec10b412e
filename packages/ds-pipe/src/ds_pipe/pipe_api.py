"""The names ``deepspeed.pipe`` serves: the pipeline model classes and the process topology."""

from ds_pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from ds_pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]

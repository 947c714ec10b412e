"""``deepspeed.runtime.pipe``: pipeline parallelism. The model classes and topology come from ds-pipe
(``deepspeed.runtime.pipe.module`` / ``.topology`` / ``.schedule`` are its modules); ``engine`` is the
``PipelineEngine`` built on the training engine."""

from ds_pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from ds_pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]

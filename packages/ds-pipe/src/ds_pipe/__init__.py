"""Pipeline parallelism: ProcessTopology, PipelineModule/LayerSpec, the pipeline schedules and engine."""

from ds_pipe.__about__ import __version__
from ds_pipe.module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from ds_pipe.schedule import (
    DataParallelSchedule,
    InferenceSchedule,
    PipeInstruction,
    PipeSchedule,
    TrainSchedule,
)
from ds_pipe.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = [
    "DataParallelSchedule",
    "LayerSpec",
    "PipelineError",
    "PipelineModule",
    "TiedLayerSpec",
    "InferenceSchedule",
    "PipeInstruction",
    "PipeSchedule",
    "TrainSchedule",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
    "__version__",
]

"""Typed, validated schema of the whole DeepSpeed config (``ds_config.json``) and the inference config.

Entry points: ``load_config`` (dict, path, JSON or base64 JSON -> ``DeepSpeedConfig``), ``ConfigError`` (every
problem with its full key path), ``resolve_batch_sizes`` (batch arithmetic), ``config_schema`` (JSON Schema).
Importing this package does not import torch.
"""

from ds_config.__about__ import __version__
from ds_config._base import (
    DeprecatedConfigWarning,
    DSConfigModel,
    UnknownConfigKeyWarning,
    validate_section,
)
from ds_config._errors import ConfigError, ConfigProblem
from ds_config._types import torch_dtype_name
from ds_config.activation_checkpointing import ActivationCheckpointingConfig
from ds_config.aio import AioConfig
from ds_config.autotuning import AutotuningConfig, ModelInfoConfig
from ds_config.batch import BatchSizes, resolve_batch_sizes
from ds_config.checkpoint import CheckpointConfig, ParallelWriteConfig
from ds_config.checks import check_compatibility, find_problems, pipeline_problems
from ds_config.comm import CommsLoggerConfig
from ds_config.compile import CompileConfig
from ds_config.compression import CompressionConfig
from ds_config.config import DeepSpeedConfig
from ds_config.data_efficiency import CurriculumLearningConfig, DataEfficiencyConfig
from ds_config.elastic import ElasticPlan, compute_elastic_config, elastic_batch_sizes, elastic_plan
from ds_config.elasticity import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)
from ds_config.flops_profiler import FlopsProfilerConfig
from ds_config.inference import (
    ActivationQuantConfig,
    DeepSpeedInferenceConfig,
    DeepSpeedMoEConfig,
    DeepSpeedTPConfig,
    DtypeEnum,
    InferenceCheckpointConfig,
    MoETypeEnum,
    QKVQuantConfig,
    QuantizationConfig,
    WeightQuantConfig,
)
from ds_config.loader import ConfigSourceError, load_config, parse_json, read_source
from ds_config.monitor import CometConfig, CSVConfig, DeepSpeedMonitorConfig, TensorBoardConfig, WandbConfig
from ds_config.optimizer import OptimizerConfig, OptimizerParams
from ds_config.parallel import (
    ExpertParallelConfig,
    LayerSpec,
    PartitionConfig,
    TensorParallelConfig,
    TPGroupConfig,
)
from ds_config.pipeline import PipelineConfig
from ds_config.precision import AMPConfig, BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig
from ds_config.scheduler import (
    LRRangeTestParams,
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from ds_config.schema import config_schema
from ds_config.sparse_attention import SparseAttentionConfig
from ds_config.training_features import EigenvalueConfig, ProgressiveLayerDropConfig
from ds_config.unbuilt import INERT_KEYS, InertConfigKeyWarning
from ds_config.zero import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DeepSpeedZeroConfig,
    DeepSpeedZeroLeafModuleConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    ZenFlowConfig,
    ZeroStageEnum,
)

__all__ = [
    "__version__",
    "ActivationCheckpointingConfig",
    "ActivationQuantConfig",
    "AioConfig",
    "AMPConfig",
    "AutotuningConfig",
    "BatchSizes",
    "BF16Config",
    "check_compatibility",
    "CheckpointConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "CompileConfig",
    "CompressionConfig",
    "config_schema",
    "ConfigError",
    "ConfigProblem",
    "ConfigSourceError",
    "CSVConfig",
    "CurriculumLearningConfig",
    "DataEfficiencyConfig",
    "DataTypesConfig",
    "DeepSpeedConfig",
    "DeepSpeedInferenceConfig",
    "DeepSpeedMoEConfig",
    "DeepSpeedMonitorConfig",
    "DeepSpeedTPConfig",
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroLeafModuleConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DeprecatedConfigWarning",
    "DSConfigModel",
    "DtypeEnum",
    "EigenvalueConfig",
    "elastic_batch_sizes",
    "compute_elastic_config",
    "ElasticityError",
    "ElasticityConfigError",
    "ElasticityIncompatibleWorldSize",
    "elastic_plan",
    "ElasticityConfig",
    "ElasticPlan",
    "ExpertParallelConfig",
    "find_problems",
    "FlopsProfilerConfig",
    "FP16Config",
    "InferenceCheckpointConfig",
    "LayerSpec",
    "load_config",
    "LRRangeTestParams",
    "ModelInfoConfig",
    "MoETypeEnum",
    "OffloadDeviceEnum",
    "OneCycleParams",
    "OptimizerConfig",
    "OptimizerParams",
    "ParallelWriteConfig",
    "parse_json",
    "PartitionConfig",
    "pipeline_problems",
    "PipelineConfig",
    "ProgressiveLayerDropConfig",
    "QKVQuantConfig",
    "QuantizationConfig",
    "read_source",
    "resolve_batch_sizes",
    "SchedulerConfig",
    "SparseAttentionConfig",
    "TensorBoardConfig",
    "TensorParallelConfig",
    "torch_dtype_name",
    "TorchAutocastConfig",
    "TPGroupConfig",
    "UnknownConfigKeyWarning",
    "InertConfigKeyWarning",
    "INERT_KEYS",
    "validate_section",
    "WandbConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "WeightQuantConfig",
    "ZenFlowConfig",
    "ZeroStageEnum",
]

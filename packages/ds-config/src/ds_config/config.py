"""The top-level DeepSpeed config (``ds_config.json``): every section, typed, with documented defaults.

``DeepSpeedConfig`` is the typed config the engine uses; ``deepspeed.runtime.config.DeepSpeedConfig`` (DeepSpeed's
class, built from a dict or path with the data-parallel world size) holds one. Build it with ``load_config``
(dict, path, JSON string or base64 JSON) or ``DeepSpeedConfig.load("ds_config.json", world_size=8)``.
"""

from __future__ import annotations

import math
import warnings
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PlainValidator, PrivateAttr, ValidationInfo, field_validator, model_validator

from ds_config._base import (
    AUTO,
    Deprecated,
    DeprecatedConfigWarning,
    DSConfigModel,
    KeepAuto,
    is_own_state,
    keeps_auto,
    validate_section,
)
from ds_config._errors import ConfigError, ConfigProblem, join_path
from ds_config._source import read_source
from ds_config._types import Auto, AutoPosInt, Bool, DType, Float, PosInt
from ds_config.activation_checkpointing import ActivationCheckpointingConfig
from ds_config.aio import AioConfig
from ds_config.autotuning import AutotuningConfig
from ds_config.batch import GAS, MBS, TBS, BatchSizes, resolve_batch_sizes
from ds_config.checkpoint import CheckpointConfig
from ds_config.checks import check_compatibility, pipeline_problems
from ds_config.comm import CommsLoggerConfig
from ds_config.compile import CompileConfig
from ds_config.compression import CompressionConfig
from ds_config.data_efficiency import CurriculumLearningConfig, DataEfficiencyConfig
from ds_config.elastic import elastic_batch_sizes, ensure_immutable_elastic_config
from ds_config.elasticity import ElasticityConfig
from ds_config.flops_profiler import FlopsProfilerConfig
from ds_config.inference import WeightQuantConfig
from ds_config.monitor import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from ds_config.optimizer import OptimizerConfig
from ds_config.parallel import ExpertParallelConfig, TensorParallelConfig
from ds_config.pipeline import PipelineConfig
from ds_config.precision import AMPConfig, BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig
from ds_config.scheduler import SchedulerConfig
from ds_config.sparse_attention import SparseAttentionConfig
from ds_config.training_features import EigenvalueConfig, ProgressiveLayerDropConfig
from ds_config.unbuilt import HybridEngineConfig, InertConfigKeyWarning, NebulaConfig, TimersConfig, warn_inert_keys
from ds_config.zero import DeepSpeedZeroConfig


def _steps_per_print(value: Any) -> int | float:
    """A positive integer, or infinity: Accelerate writes ``float("inf")`` (JSON ``Infinity``) for "never"."""
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    if isinstance(value, float) and (value == math.inf or (value.is_integer() and value > 0)):
        return value if value == math.inf else int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError("expected a positive integer or Infinity")


StepsPerPrint = Annotated[int | float, PlainValidator(_steps_per_print,
                                                      json_schema_input_type=int | Literal["Infinity"])]
GradientClipping = Annotated[Annotated[Float, Field(ge=0)] | Auto, KeepAuto()]
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
TENSOR_CORE_ALIGN_SIZE = 8


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _log_level(value: Any) -> str:
    # checked case-insensitively but kept as written: DeepSpeed's engine.log_level() returns the config's spelling
    if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
        raise ValueError(f"not a log level; accepted (any case): {', '.join(LOG_LEVELS)}")
    return value


LogLevel = Annotated[str, PlainValidator(_log_level, json_schema_input_type=Literal[LOG_LEVELS])]


class DeepSpeedConfig(DSConfigModel):
    """The whole DeepSpeed config. Unset sections hold their documented defaults."""

    json_schema_ref: str | None = Field(None, alias="$schema", exclude=True)
    """Editors' ``"$schema"`` reference (e.g. to the output of ``python -m ds_config schema``); ignored."""

    # -- batch size (derived for a world size by ``resolve_batch``) --
    train_batch_size: AutoPosInt | None = None
    """Global batch: micro batch per GPU x gradient accumulation steps x data-parallel ranks."""
    train_micro_batch_size_per_gpu: AutoPosInt | None = None
    """Samples one GPU processes per forward/backward (default: derived from ``train_batch_size``)."""
    gradient_accumulation_steps: AutoPosInt | None = None
    """Micro-steps accumulated before each optimizer step (default 1 when it cannot be derived)."""
    managed_gradient_accumulation: Bool = True
    """True: the engine counts micro-steps and updates on every ``gradient_accumulation_steps``-th ``step()``.
    False: every ``step()`` is the boundary (reduce what the backward calls since the last step accumulated, then
    update); the caller decides how many backward calls a step gets. Not with pipeline parallelism, DeepCompile,
    or ``overlap_comm`` at ZeRO stage 0/1."""

    # -- optimizer and schedule --
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_allow_untested_optimizer: Bool = False
    """Allow ZeRO with a client optimizer DeepSpeed has not tested."""
    zero_force_ds_cpu_optimizer: Bool = True
    """With optimizer offload, insist on DeepSpeed's CPU optimizer (DeepSpeedCPUAdam)."""
    gradient_clipping: GradientClipping = 0.0
    """Clip the global gradient norm to this value (0 disables)."""

    # -- communication --
    fp32_allreduce: Bool = False
    """All-reduce gradients in fp32."""
    prescale_gradients: Bool = False
    """Scale gradients before the all-reduce."""
    gradient_predivide_factor: Float = Field(1.0, gt=0)
    """Divide gradients by this factor before averaging (fp16 stability at large scale)."""
    sparse_gradients: Bool = False
    """Sparse all-reduce of ``torch.nn.Embedding`` gradients (essentially deprecated)."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """Data-parallel gradient reduction: ``mean`` averages over the data-parallel ranks, ``sum`` adds them
    (no division; not with ZeRO-3, DeepCompile or ZenFlow). Case-insensitive."""
    communication_data_type: DType | None = None
    """dtype of gradient communication; ``None`` follows the training precision."""
    seq_parallel_communication_data_type: DType = "fp32"
    """dtype of sequence-parallel communication."""
    data_parallel_size: PosInt | None = None
    """With ``sequence_parallel_size``: the data-parallel size of the (data, sequence) mesh; it must equal the
    world size over ``sequence_parallel_size`` (the engine checks)."""
    sequence_parallel_size: PosInt = 1
    """Ranks that split each sample's sequence (DeepSpeed-Ulysses, AutoSP); without a client ``mpu`` the engine
    builds groups of this many consecutive ranks, and the data-parallel size is the world size over it."""
    disable_allgather: Bool = False
    use_data_before_expert_parallelism: Bool = False
    """MoE groups: consecutive ranks form the expert-data-parallel groups instead of the expert-parallel ones."""
    allgather_size: PosInt | None = None
    """With the deprecated ``"zero_optimization": true``: its ``allgather_bucket_size``."""

    # -- precision --
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    bfloat16: Annotated[dict[str, Any] | None, Deprecated(new="bf16")] = Field(None, exclude=True)
    """Deprecated name of ``bf16``."""
    amp: AMPConfig = Field(default_factory=AMPConfig)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)

    # -- ZeRO, offload I/O, parallelism --
    zero_optimization: DeepSpeedZeroConfig = Field(default_factory=DeepSpeedZeroConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    dataloader_drop_last: Bool = False
    """``deepspeed_io``'s data loader drops each rank's last, incomplete micro batch."""

    # -- logging, profiling, monitoring --
    steps_per_print: StepsPerPrint = 10
    """Report progress every N steps; ``Infinity`` never reports."""
    wall_clock_breakdown: Bool = False
    """Time forward/backward/step phases."""
    dump_state: Bool = False
    """Print the engine's state after initialisation."""
    memory_breakdown: Bool = False
    """Report memory use at key points."""
    log_level: LogLevel | None = None
    """Level of DeepSpeed's logger set by ``initialize`` (case-insensitive, kept as written); ``None`` keeps it."""
    vocabulary_size: PosInt | None = None
    """Only checked: a size that is not a multiple of 8 gets DeepSpeed's tensor-core alignment warning."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)

    # -- training features --
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    sparse_attention: SparseAttentionConfig | None = None
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    curriculum_learning: CurriculumLearningConfig = Field(default_factory=CurriculumLearningConfig)
    compression_training: CompressionConfig = Field(default_factory=CompressionConfig)
    eigenvalue: EigenvalueConfig = Field(default_factory=EigenvalueConfig)
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(default_factory=ProgressiveLayerDropConfig)

    # -- read by DeepSpeed's parser, features not built here (validated; unbuilt.INERT_KEYS warns) --
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    nebula: NebulaConfig = Field(default_factory=NebulaConfig)
    timers: TimersConfig = Field(default_factory=TimersConfig)
    weight_quantization: WeightQuantConfig | None = None
    datastates_ckpt: dict[str, Any] | Bool | None = None
    graph_harvesting: Bool = False
    disable_python_gc: Bool = False
    quantize_training: dict[str, Any] | None = None

    _batch: BatchSizes | None = PrivateAttr(default=None)

    @classmethod
    def load(cls, source: Any, *, world_size: int | None = None, strict: bool = True) -> DeepSpeedConfig:
        """Parse ``source`` (dict, path, JSON text or base64 JSON); see ``ds_config.load_config``."""
        return load_config(source, world_size=world_size, strict=strict)

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_only_keys(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and not is_own_state(cls, data, info):
            data = _drop_dotted_keys(cls, data)
            warn_inert_keys(data)
            if data.get("zero_optimization") is True and data.get("allgather_size") is not None:
                warnings.warn("a boolean 'zero_optimization' is deprecated; use {\"stage\": N} (allgather_size "
                              "becomes zero_optimization.allgather_bucket_size)", DeprecatedConfigWarning, stacklevel=2)
                data = {**data, "zero_optimization": {"stage": 1, "allgather_bucket_size": data["allgather_size"]}}
        return data

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _allreduce_op(cls, value: Any) -> Any:
        value = _lower(value)
        if value not in ("mean", "sum"):  # DeepSpeed's wording, which its callers match on
            raise ValueError("Invalid gradient_allreduce_op. Supported operations: ['mean', 'sum']")
        return value

    @field_validator("vocabulary_size")
    @classmethod
    def _tensor_core_alignment(cls, value: int | None) -> int | None:
        if value is not None and value % TENSOR_CORE_ALIGN_SIZE:
            warnings.warn(f"vocabulary_size {value} is not a multiple of {TENSOR_CORE_ALIGN_SIZE}: tensor-core "
                          "utilisation may suffer (DeepSpeed's warning)", UserWarning, stacklevel=2)
        return value

    @field_validator("sparse_gradients")
    @classmethod
    def _sparse_gradients_deprecated(cls, value: bool) -> bool:
        if value:
            warnings.warn("sparse_gradients is essentially deprecated (documented as such) and not compatible "
                          "with torch.sparse features", DeprecatedConfigWarning, stacklevel=2)
        return value

    @model_validator(mode="after")
    def _cross_section(self) -> DeepSpeedConfig:
        check_compatibility(self)
        return self

    # ---- derived values the engine needs ----
    @property
    def zero_stage(self) -> int:
        return int(self.zero_optimization.stage)

    @property
    def zero_enabled(self) -> bool:
        return self.zero_stage > 0

    @property
    def fp16_enabled(self) -> bool:
        return self.fp16.enabled

    @property
    def bf16_enabled(self) -> bool:
        return self.bf16.enabled

    @property
    def amp_enabled(self) -> bool:
        return self.amp.enabled

    @property
    def torch_autocast_enabled(self) -> bool:
        return self.torch_autocast.enabled

    @property
    def precision(self) -> str:
        """Training dtype of the model weights: ``"fp16"``, ``"bf16"`` or ``"fp32"``."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    # DeepSpeed's flat names for the data_types keys (its DeepSpeedConfig attributes; None when not set)
    @property
    def grad_accum_dtype(self) -> str | None:
        return self.data_types.grad_accum_dtype

    @property
    def param_dtype(self) -> str | None:
        return self.data_types.param_dtype

    @property
    def buffer_dtype(self) -> str | None:
        return self.data_types.buffer_dtype

    @property
    def initial_dynamic_scale(self) -> float:
        """Starting loss scale of fp16 dynamic loss scaling: ``2 ** fp16.initial_scale_power``."""
        return float(2 ** self.fp16.initial_scale_power)

    @property
    def dynamic_loss_scale_args(self) -> dict[str, Any] | None:
        """Arguments of the dynamic loss scaler (DeepSpeed's names), or ``None`` for a static loss scale."""
        if not self.fp16.dynamic_loss_scale:
            return None
        return {"init_scale": self.initial_dynamic_scale, "scale_window": self.fp16.loss_scale_window,
                "delayed_shift": self.fp16.hysteresis, "consecutive_hysteresis": self.fp16.consecutive_hysteresis,
                "min_scale": self.fp16.min_loss_scale}

    @property
    def optimizer_name(self) -> str | None:
        return self.optimizer.name if self.optimizer else None

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        return self.optimizer.constructor_params() if self.optimizer else None

    @property
    def scheduler_name(self) -> str | None:
        return self.scheduler.type if self.scheduler else None

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        return self.scheduler.constructor_params() if self.scheduler else None

    @property
    def batch(self) -> BatchSizes:
        """Derived batch numbers; available after ``resolve_batch(world_size)`` (or ``world_size=`` at load)."""
        if self._batch is None:
            raise ConfigError(ConfigProblem("train_batch_size", "batch sizes are not resolved yet: call "
                                            "resolve_batch(world_size) once the data-parallel size is known"))
        return self._batch

    def resolve_batch(self, world_size: int) -> BatchSizes:
        """Derive and store the three batch keys for ``world_size`` data-parallel ranks (``batch.py``, or
        ``elastic.py`` when elasticity is enabled)."""
        if self.elasticity.enabled:  # elastic training owns the batch keys
            ensure_immutable_elastic_config(self.elasticity.model_dump())  # the scheduler planned with the same
            sizes = elastic_batch_sizes(self.elasticity, world_size)
        else:
            sizes = resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                        self.gradient_accumulation_steps, world_size=world_size)
        # plain ints computed above: store without re-running the cross-section checks on every assignment
        self.__dict__.update(sizes.as_dict())
        self._batch = sizes
        return sizes

    def check_pipeline(self, num_stages: int) -> None:
        """Raise ``ConfigError`` if this config cannot run with ``num_stages`` pipeline stages."""
        problems = pipeline_problems(self, num_stages)
        if problems:
            raise ConfigError(problems)

    def auto_keys(self) -> list[str]:
        """Dotted paths of every value still ``"auto"`` (Hugging Face fills these in before training)."""
        return _auto_paths(self, "")

    def require_resolved(self) -> None:
        """Raise ``ConfigError`` naming every key still ``"auto"``; the engine calls this at start-up."""
        keys = self.auto_keys()
        if keys:
            raise ConfigError([ConfigProblem(k, "is still \"auto\": set a value, or let the Hugging Face "
                                                "Trainer/Accelerate integration fill it in before "
                                                "deepspeed.initialize") for k in keys])

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON-ready data (defaults filled in)."""
        return self.model_dump(mode="json", exclude_none=False)


def _drop_dotted_keys(cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys such as ``"zero_optimization.reduce_bucket_size"`` (TRL's ``prepare_deepspeed`` writes
    them): DeepSpeed reads nested sections only and ignores these, so they are dropped with a warning saying
    so. A dotted key whose first part is no section stays, and is reported as unknown (a typo)."""
    candidates = [k for k in data if isinstance(k, str) and "." in k]
    if not candidates:
        return data
    sections = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
    dotted = [k for k in candidates if k.partition(".")[0] in sections]
    for key in dotted:
        section, _, rest = key.partition(".")
        warnings.warn(f"config key '{key}' has no effect: DeepSpeed reads nested sections only and ignores a dotted "
                      f"top-level name (to set it, write {{\"{section}\": {{\"{rest}\": ...}}}})",
                      InertConfigKeyWarning, stacklevel=4)
    return {k: v for k, v in data.items() if k not in dotted} if dotted else data


def load_config(source: Any, *, world_size: int | None = None, strict: bool = True) -> DeepSpeedConfig:
    """Parse and validate a DeepSpeed config.

    ``source``: dict, path (str or ``Path``) to a JSON file, JSON text, or base64-encoded JSON.
    ``world_size``: data-parallel size; when given, the batch keys are derived and checked.
    ``strict=False``: unknown keys warn (``UnknownConfigKeyWarning``) and are dropped instead of failing.
    Raises ``ConfigError`` (a ``ValueError``) whose problems name each bad key's full path.
    """
    if isinstance(source, DeepSpeedConfig):
        config = source
    else:
        data = read_source(source)
        try:
            config = validate_section(DeepSpeedConfig, data, strict=strict)
        except ConfigError as exc:
            hidden = _hidden_problems(data, exc.paths, world_size)
            # an error of one kind (ElasticityConfigError, ...) keeps its class when nothing is added to it
            raise (ConfigError if hidden else type(exc))(exc.problems + hidden) from None
    if world_size is not None:
        config.resolve_batch(world_size)
    return config


def _hidden_problems(data: dict[str, Any], reported: list[str], world_size: int | None) -> list[ConfigProblem]:
    """Problems a failed validation could not reach, so one run shows them all: cross-section checks (which
    need every section valid) among the sections that did validate, and the batch arithmetic.

    The sections with errors are left out (so they take their defaults, which are all "off" and cannot
    create a conflict of their own).
    """
    bad = {path.split(".")[0].split("[")[0] for path in reported}
    rest = {key: value for key, value in data.items() if key not in bad}
    extra: list[ConfigProblem] = []
    if len(rest) < len(data):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecations were already reported by the first validation
            try:
                validate_section(DeepSpeedConfig, rest, strict=False)
            except ConfigError as exc:
                extra = exc.problems
    if world_size is not None:
        extra += _batch_problems(data, world_size)
    seen = set(reported)
    return [p for p in extra if p.path not in seen and not seen.add(p.path)]


def _batch_problems(data: dict[str, Any], world_size: int) -> list[ConfigProblem]:
    """Batch-arithmetic problems of a config that failed validation elsewhere, so one run shows them all.

    Only plain positive integers are checked: a wrong type is already reported by validation, and elastic
    training (which owns the batch keys) is left to ``resolve_batch``.
    """
    values = [data.get(key) for key in (TBS, MBS, GAS)]
    elastic = data.get("elasticity")
    if isinstance(elastic, dict) and elastic.get("enabled"):
        return []
    if any(v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0) for v in values):
        return []
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        return []
    try:
        resolve_batch_sizes(*values, world_size=world_size)
    except ConfigError as exc:
        return exc.problems
    return []


def _auto_paths(model: DSConfigModel, path: str) -> list[str]:
    out: list[str] = []
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        where = join_path(path, name)
        if value == AUTO and keeps_auto(field):
            out.append(where)
        elif isinstance(value, DSConfigModel):
            out.extend(_auto_paths(value, where))
    for key, value in (model.model_extra or {}).items():
        if value == AUTO:
            out.append(join_path(path, key))
    return out

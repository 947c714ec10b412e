"""``data_efficiency`` (curriculum data sampling, dynamic batching, random-LTD) and the legacy ``curriculum_learning``.

Defaults follow the Data Efficiency and Curriculum Learning chapters of the config reference. Keys the
reference marks "N/A" have no default: they are required once their feature is enabled, and the error names
the missing key. The keys a curriculum ``schedule_config`` needs depend on ``schedule_type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ds_config._base import Deprecated, DSConfigModel
from ds_config._errors import _MISSING, ConfigError, ConfigProblem, join_path

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]

#: keys of ``schedule_config`` each curriculum schedule needs (``custom`` is driven by a user callback)
SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}


def _error_at(where: str | tuple, message: str, value: Any = _MISSING, **ctx: Any) -> ConfigError:
    """A ``ConfigError`` at ``where`` (a key path relative to the model being validated; the base class
    prefixes the section's path). ``message`` is formatted with ``ctx``."""
    path = join_path(*where) if isinstance(where, tuple) else where
    return ConfigError(ConfigProblem(path, message.format(**ctx), value))


def _require(model: DSConfigModel, names: tuple[str, ...], why: str, at: tuple = ()) -> None:
    """Raise for the first of ``names`` that is still None, saying why it is needed."""
    for name in names:
        if getattr(model, name) is None:
            raise _error_at((*at, name), "'{key}' is required when {why}", key=name, why=why)


class CurriculumScheduleConfig(DSConfigModel):
    """``schedule_config`` of a curriculum: the pacing function's parameters."""

    total_curriculum_step: int | None = Field(None, ge=1)
    """Steps to go from min to max difficulty (fixed_linear, fixed_root)."""
    difficulty_step: int | None = Field(None, ge=1)
    """The difficulty is always a multiple of this (fixed_linear, fixed_root); 8 or 16 suits Tensor Cores."""
    root_degree: int | None = Field(None, ge=1)
    """Degree of the root function: 2 = square root, 1 = linear (fixed_root)."""
    difficulty: list[int] | None = None
    """Difficulty levels, in order (fixed_discrete)."""
    max_step: list[int] | None = None
    """Step at which each difficulty level ends (fixed_discrete)."""

    def check_for(self, schedule_type: str, at: tuple = ()) -> None:
        """Raise unless exactly the keys ``schedule_type`` needs are present; ``at`` is where this dict sits."""
        needed = SCHEDULE_KEYS[schedule_type]
        for name in needed:
            if getattr(self, name) is None:
                raise _error_at((*at, name), "'{key}' is required in schedule_config for schedule_type "
                                "'{st}' (it needs: {needed})", key=name, st=schedule_type, needed=", ".join(needed))
        for name in type(self).model_fields:
            if name not in needed and getattr(self, name) is not None:
                raise _error_at((*at, name), "'{key}' is not used by schedule_type '{st}' (it uses: "
                                "{needed})", getattr(self, name), key=name, st=schedule_type,
                                needed=", ".join(needed) or "no schedule_config keys")
        if schedule_type == "fixed_discrete" and len(self.difficulty) != len(self.max_step) + 1:
            raise _error_at((*at, "max_step"), "fixed_discrete needs one max_step per difficulty "
                            "level except the last ({n} difficulty levels -> {m} max_step entries)",
                            self.max_step, n=len(self.difficulty), m=len(self.difficulty) - 1)


def _check_schedule(model: Any, schedule_type: str | None) -> None:
    """Check ``model.schedule_config`` against ``schedule_type``, with locations under ``schedule_config``."""
    if schedule_type is None:
        return
    config = model.schedule_config
    if config is None:
        if schedule_type == "custom":
            return
        raise _error_at(("schedule_config",), "'schedule_config' is required for schedule_type '{st}' "
                        "(it needs: {needed})", st=schedule_type, needed=", ".join(SCHEDULE_KEYS[schedule_type]))
    config.check_for(schedule_type, at=("schedule_config",))


def _check_difficulty_range(model: Any) -> None:
    if model.min_difficulty is not None and model.max_difficulty is not None \
            and model.min_difficulty > model.max_difficulty:
        raise _error_at(("max_difficulty",), "max_difficulty must be >= min_difficulty ({lo})",
                        model.max_difficulty, lo=model.min_difficulty)


class CurriculumLearningConfig(DSConfigModel):
    """Legacy top-level ``curriculum_learning`` (sequence-length curriculum)."""

    enabled: bool = False
    """Enable legacy curriculum learning."""
    curriculum_type: Literal["seqlen"] | None = None
    """Difficulty metric; ``seqlen`` (sequence length) is the one supported."""
    min_difficulty: int | None = None
    """Starting difficulty level."""
    max_difficulty: int | None = None
    """Final difficulty level."""
    schedule_type: ScheduleType | None = None
    """Pacing function: fixed_linear, fixed_root, fixed_discrete (or custom with a user callback)."""
    schedule_config: CurriculumScheduleConfig | None = None
    """Parameters of the pacing function; which keys depends on ``schedule_type``."""

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> CurriculumLearningConfig:
        if self.enabled:
            _require(self, ("curriculum_type", "min_difficulty", "max_difficulty", "schedule_type"),
                     "curriculum learning is enabled")
        _check_difficulty_range(self)
        _check_schedule(self, self.schedule_type)
        return self


class CurriculumMetricConfig(DSConfigModel):
    """One entry of ``curriculum_metrics`` (the key is the metric's name)."""

    index_to_sample_path: str | None = None
    """index_to_sample file from offline data analysis (needed for ``schedule_based`` clustering)."""
    index_to_metric_path: str | None = None
    """index_to_metric file from offline data analysis (needed for ``schedule_based`` clustering by ``value``)."""
    difficulty_type: Literal["value", "percentile"] | None = None
    """Raise the max accepted difficulty by absolute value or by percentile."""
    clustering_type: Literal["schedule_based", "single_cluster"] | None = None
    """Cluster data by the schedule, or a single cluster (curriculum done by post-processing)."""
    min_difficulty: int | None = None
    """Starting difficulty (a value or a percentile, per ``difficulty_type``)."""
    max_difficulty: int | None = None
    """Final difficulty (a value or a percentile, per ``difficulty_type``)."""
    schedule_type: ScheduleType | None = None
    """Pacing function: fixed_linear, fixed_root, fixed_discrete or custom (callback)."""
    schedule_config: CurriculumScheduleConfig | None = None
    """Parameters of the pacing function; not needed for ``custom``."""

    @model_validator(mode="after")
    def _consistent(self) -> CurriculumMetricConfig:
        # no defaults in the reference: a metric is unusable without these (named here, not as "Field required")
        _require(self, ("difficulty_type", "clustering_type", "min_difficulty", "max_difficulty", "schedule_type"),
                 "defining a curriculum metric")
        if self.clustering_type == "schedule_based":  # the sampler reads index_to_metric for value difficulty only
            _require(self, ("index_to_sample_path",), "clustering_type is 'schedule_based'")
            if self.difficulty_type == "value":
                _require(self, ("index_to_metric_path",), "clustering_type is 'schedule_based' and difficulty_type "
                         "is 'value'")
        if self.difficulty_type == "percentile":
            for name in ("min_difficulty", "max_difficulty"):
                if not 0 <= getattr(self, name) <= 100:
                    raise _error_at((name,), "a percentile difficulty must be within 0..100",
                                    getattr(self, name))
            if self.max_difficulty < 1:  # the sampler splits the samples into max_difficulty percentiles
                raise _error_at(("max_difficulty",), "a percentile max_difficulty must be within 1..100",
                                self.max_difficulty)
        _check_difficulty_range(self)
        _check_schedule(self, self.schedule_type)
        return self


class DataSamplingCurriculumConfig(DSConfigModel):
    """``data_efficiency.data_sampling.curriculum_learning``: metric-based curriculum data sampling."""

    enabled: bool = False
    """Enable curriculum data sampling."""
    data_cluster_path: str | None = None
    """Directory where the sampler stores the indexes of samples in each difficulty range."""
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)
    """Metric name -> its curriculum config."""

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> DataSamplingCurriculumConfig:
        if self.enabled:
            _require(self, ("data_cluster_path",), "curriculum learning is enabled")
            if not self.curriculum_metrics:
                raise _error_at(("curriculum_metrics",),
                                "curriculum learning is enabled: give at least one metric in curriculum_metrics")
        return self


class DynamicBatchingConfig(DSConfigModel):
    """``data_efficiency.data_sampling.dynamic_batching``: variable batch size by token budget, with LR scaling.

    Keys and defaults are DeepSpeed's (``max_tokens``, ``sequence_picking_order``, ``metrics_path``); the names of
    its first release (``max_tokens_per_batch``, ``samples_order``) are accepted with a deprecation warning.
    """

    enabled: bool = False
    """Pack samples into micro batches of at most ``max_tokens`` tokens (the batch size varies)."""
    metrics_path: str | None = None
    """DataAnalyzer output folder holding ``seqlen/seqlen_sample_to_metric`` (sample -> sequence length)."""
    seqlen_sample_to_metric_path: str | None = None
    """The sample -> sequence length file prefix itself (``.bin``/``.idx``); overrides ``metrics_path``."""
    lr_scaling_method: Literal["linear", "sqrt", "none"] = "linear"
    """How the learning rate follows the batch size (relative to ``train_batch_size``)."""
    min_batch_size: int = Field(1, ge=1)
    """Fewest samples in a micro batch."""
    max_batch_size: int | None = Field(None, ge=1)
    """Most samples in a micro batch; None = only ``max_tokens`` limits it."""
    sequence_picking_order: Literal["dataloader", "random", "seqlen"] = "dataloader"
    """Order samples are packed in: dataset order, shuffled (``data_efficiency.seed``) or by ascending length."""
    max_tokens: int | None = Field(None, ge=1)
    """Token budget (sum of sequence lengths) of one micro batch (required when enabled)."""
    verbose: bool = False
    """Log every batch built and every scaled learning rate."""
    max_tokens_per_batch: Annotated[int | None, Deprecated(new="max_tokens")] = Field(None, exclude=True)
    """Deprecated name of ``max_tokens``."""
    samples_order: Annotated[Literal["dataloader", "random", "seqlen"] | None,
                             Deprecated(new="sequence_picking_order")] = Field(None, exclude=True)
    """Deprecated name of ``sequence_picking_order``."""

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> DynamicBatchingConfig:
        if self.enabled:
            _require(self, ("max_tokens",), "dynamic batching is enabled")
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise _error_at(("max_batch_size",), "max_batch_size must be >= min_batch_size ({lo})",
                            self.max_batch_size, lo=self.min_batch_size)
        if self.metrics_path is not None and self.seqlen_sample_to_metric_path is not None:
            raise _error_at(("seqlen_sample_to_metric_path",), "give either metrics_path (the DataAnalyzer folder) "
                            "or seqlen_sample_to_metric_path (the file prefix), not both",
                            self.seqlen_sample_to_metric_path)
        return self

    def seqlen_file_prefix(self) -> str | None:
        """Prefix of the sample -> sequence length ``MMapIndexedDataset`` files, or None when neither path is set."""
        if self.seqlen_sample_to_metric_path is not None:
            return self.seqlen_sample_to_metric_path
        if self.metrics_path is None:
            return None
        return self.metrics_path.rstrip("/") + "/seqlen/seqlen_sample_to_metric"


class DataSamplingConfig(DSConfigModel):
    """``data_efficiency.data_sampling``."""

    enabled: bool = False
    """Enable data sampling techniques."""
    num_epochs: int = Field(1000, ge=1)
    """At most this many epochs of the original dataset are iterated."""
    num_workers: int = Field(0, ge=0)
    """Data loader workers."""
    pin_memory: bool = False
    """Pin the memory of the dynamic-batching data loader's batches."""
    curriculum_learning: DataSamplingCurriculumConfig = Field(default_factory=DataSamplingCurriculumConfig)
    """Curriculum learning by data sampling."""
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    """Token-budget batching with learning-rate scaling."""


class RandomLTDScheduleConfigParams(DSConfigModel):
    """``random_ltd_schedule.schedule_config``."""

    require_steps: int | None = Field(None, ge=1)
    """Iterations to go from ``min_value`` to ``max_value``."""
    seq_per_step: int | None = Field(None, ge=1)
    """The effective sequence length is always a multiple of this (8 for FP16, 16 for INT8 Tensor Cores)."""


class RandomLTDScheduleConfig(DSConfigModel):
    """``random_ltd.random_ltd_schedule``: effective sequence length (tokens kept) over training."""

    min_value: int | None = Field(None, ge=1)
    """Effective sequence length at step 0."""
    max_value: int | None = Field(None, ge=1)
    """Final effective sequence length (usually the baseline sequence length)."""
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    """Only a linear increase is supported."""
    schedule_config: RandomLTDScheduleConfigParams = Field(default_factory=RandomLTDScheduleConfigParams)
    """Parameters of the linear increase."""

    def check_complete(self, at: tuple = ()) -> None:
        """Raise for a missing key; ``at`` is where this dict sits."""
        _require(self, ("min_value", "max_value"), "random-LTD is enabled", at)
        for name in ("require_steps", "seq_per_step"):
            if getattr(self.schedule_config, name) is None:
                raise _error_at((*at, "schedule_config", name), "'{key}' is required when random-LTD is "
                                "enabled", key=name)
        if self.min_value > self.max_value:
            raise _error_at((*at, "max_value"), "max_value must be >= min_value ({lo})", self.max_value,
                            lo=self.min_value)


class LayerTokenLRScheduleConfig(DSConfigModel):
    """``random_ltd.layer_token_lr_schedule``: learning-rate schedule driven by consumed layer-tokens."""

    enabled: bool = False
    """Schedule the learning rate by layer-tokens instead of steps."""
    total_layer_tokens: int | None = Field(None, ge=1)
    """Layer-tokens over the whole run (required when enabled)."""
    warmup_type: str | None = None
    """Warmup shape (e.g. ``linear``)."""
    warmup_layer_tokens: int | None = Field(None, ge=0)
    """Layer-tokens of warmup."""

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> LayerTokenLRScheduleConfig:
        if self.enabled:
            _require(self, ("total_layer_tokens",), "layer_token_lr_schedule is enabled")
        return self


class RandomLTDConfig(DSConfigModel):
    """``data_efficiency.data_routing.random_ltd``: random layerwise token dropping."""

    enabled: bool = False
    """Enable random-LTD."""
    total_layer_num: int | None = Field(None, ge=1)
    """Depth of the model (layers)."""
    random_ltd_layer_num: int | None = Field(None, ge=1)
    """Number of layers random-LTD applies to."""
    random_ltd_layer_id: list[int] | None = None
    """Ids of those layers; as many as ``random_ltd_layer_num``."""
    model_mask_name: str | None = None
    """Keyword name of the attention mask in the model's forward (e.g. ``attention_mask``)."""
    model_type: Literal["decoder", "encoder"] | None = None
    """Decoder or encoder model."""
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] | None = None
    """Layout of the hidden-state tensor."""
    random_ltd_schedule: RandomLTDScheduleConfig = Field(default_factory=RandomLTDScheduleConfig)
    """Schedule of the effective sequence length."""
    layer_token_lr_schedule: LayerTokenLRScheduleConfig = Field(default_factory=LayerTokenLRScheduleConfig)
    """Optional learning-rate schedule by layer-tokens."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Filled in by the engine (train_micro_batch_size_per_gpu); not user input."""
    global_batch_size: int | None = Field(None, ge=1)
    """Filled in by the engine (train_batch_size); not user input."""

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> RandomLTDConfig:
        if not self.enabled:
            return self
        _require(self, ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name",
                        "model_type", "hidden_state_order"), "random-LTD is enabled")
        ids = self.random_ltd_layer_id
        if len(ids) != self.random_ltd_layer_num:
            raise _error_at(("random_ltd_layer_id",), "must list random_ltd_layer_num ({n}) layer "
                            "ids, got {m}", ids, n=self.random_ltd_layer_num, m=len(ids))
        bad = [i for i in ids if not 0 <= i < self.total_layer_num]
        if bad:
            raise _error_at(("random_ltd_layer_id",), "layer ids {bad} are outside 0..{top} "
                            "(total_layer_num is {n})", ids, bad=bad, top=self.total_layer_num - 1,
                            n=self.total_layer_num)
        self.random_ltd_schedule.check_complete(at=("random_ltd_schedule",))
        return self


class DataRoutingConfig(DSConfigModel):
    """``data_efficiency.data_routing``."""

    enabled: bool = False
    """Enable data routing techniques."""
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig)
    """Random layerwise token dropping."""


class DataEfficiencyConfig(DSConfigModel):
    """The ``data_efficiency`` section (DeepSpeed Data Efficiency Library)."""

    enabled: bool = False
    """Enable the data efficiency library."""
    seed: int = 1234
    """Random seed for data sampling."""
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    """Data sampling techniques (curriculum learning, dynamic batching)."""
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)
    """Data routing techniques (random-LTD)."""

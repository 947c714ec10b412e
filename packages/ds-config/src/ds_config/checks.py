"""Cross-section checks: combinations of individually valid sections that DeepSpeed cannot run.

Each problem names the key that has to change and says why. ZeRO-internal checks (offload_param below stage
3, nvme without nvme_path, ...) live in the ZeRO section itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_config._errors import ConfigError, ConfigProblem
from ds_config.elasticity import ElasticityConfigError

if TYPE_CHECKING:
    from ds_config.config import DeepSpeedConfig

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_ELASTIC_BATCH = "elastic training is enabled"


def _precision(cfg: DeepSpeedConfig) -> list[ConfigProblem]:
    out = []
    if cfg.fp16.enabled and cfg.bf16.enabled:
        out.append(ConfigProblem("bf16.enabled", "fp16 and bf16 cannot both be enabled: they are two "
                                 "different mixed-precision modes; enable only one"))
    if cfg.amp.enabled and cfg.fp16.enabled:
        out.append(ConfigProblem("amp.enabled", "amp cannot be combined with fp16: both would manage fp16 "
                                 "casting and loss scaling; use only one"))
    if cfg.amp.enabled and cfg.bf16.enabled:
        out.append(ConfigProblem("amp.enabled", "amp cannot be combined with bf16: Apex AMP manages its own "
                                 "precision; use only one"))
    if cfg.amp.enabled and cfg.zero_stage > 0:
        out.append(ConfigProblem("amp.enabled", f"amp is not compatible with ZeRO (zero_optimization.stage="
                                 f"{cfg.zero_stage}): ZeRO needs DeepSpeed's own fp16/bf16 optimizer wrapper; "
                                 "use fp16 or bf16 instead of amp, or set stage 0"))
    return out


def _parallel(cfg: DeepSpeedConfig) -> list[ConfigProblem]:
    out = []
    stage = cfg.zero_stage
    if cfg.tensor_parallel.enabled and stage == 3:
        # each tensor shard is partitioned over its data-parallel group; ZeRO-3's gradient norm and fp16 overflow
        # check span that group only, so what needs the tensor group to agree is refused rather than run apart
        if cfg.gradient_clipping > 0:
            out.append(ConfigProblem("gradient_clipping", "AutoTP (tensor_parallel.autotp_size > 1) with ZeRO stage "
                                     "3 does not clip yet: the norm would not span the tensor-parallel group; "
                                     "accepted: 0 (or ZeRO stage 0, 1, 2)", cfg.gradient_clipping))
        if cfg.fp16_enabled:
            out.append(ConfigProblem("fp16.enabled", "AutoTP (tensor_parallel.autotp_size > 1) with ZeRO stage 3 "
                                     "trains in bf16 or fp32: fp16's overflow check would not span the "
                                     "tensor-parallel group; accepted: false (or ZeRO stage 0, 1, 2)", True))
    # AutoEP with ZeRO stage 3: the engine checks what it cannot combine with (MiCS, hpZ, qgZ, sequence parallel)
    # AutoEP with AutoTP folds the expert groups onto the tensor-parallel ranks; ds_moe.autoep.folding checks it
    if cfg.compile.deepcompile and cfg.expert_parallel.enabled and cfg.tensor_parallel.enabled:
        out.append(ConfigProblem("compile.deepcompile", "DeepCompile does not compile a model with AutoEP+AutoTP "
                                 "folding (expert_parallel with tensor_parallel.autotp_size > 1): its passes do not "
                                 "know the folded expert and tensor groups (DeepSpeed refuses the combination "
                                 "too); accepted: false here", True))
    if cfg.compile.autosp and stage not in (0, 1):
        out.append(ConfigProblem("compile.passes", f"AutoSP trains with ZeRO stage 0 or 1 (zero_optimization.stage "
                                 f"is {stage}): sequence sharding by the compiler does not compose with partitioned "
                                 "gradients or parameters yet; accepted: stage 0, 1"))
    if isinstance(cfg.pipeline.stages, int) and cfg.pipeline.stages > 1:
        out.extend(pipeline_problems(cfg, cfg.pipeline.stages))
    return out


def pipeline_problems(cfg: DeepSpeedConfig, num_stages: int) -> list[ConfigProblem]:
    """Problems of running ``cfg`` with ``num_stages`` pipeline stages (the engine calls this once the model's
    ``PipelineModule`` is known)."""
    if num_stages > 1 and cfg.zero_stage >= 2:
        return [ConfigProblem("zero_optimization.stage", f"pipeline parallelism ({num_stages} stages) works with "
                              "ZeRO stage 0 or 1 only: ZeRO-2/3 partition gradients (and parameters) while the "
                              "pipeline accumulates them across micro-batches", cfg.zero_stage)]
    return []


def _elasticity(cfg: DeepSpeedConfig) -> list[ConfigProblem]:
    if not cfg.elasticity.enabled or cfg.elasticity.ignore_non_elastic_batch_info:
        return []
    given = [k for k in BATCH_KEYS if k in cfg.model_fields_set]
    return [ConfigProblem(k, f"{_ELASTIC_BATCH}, so batch sizes come from the elasticity section; "
                             "remove this key or set elasticity.ignore_non_elastic_batch_info") for k in given]


def _reduction(cfg: DeepSpeedConfig) -> list[ConfigProblem]:
    """DeepSpeed's refusals of ``gradient_allreduce_op: sum`` and of a ``param_dtype`` off the precision."""
    out = []
    if cfg.gradient_allreduce_op == "sum":
        for name, on in (("ZeRO stage 3", cfg.zero_stage == 3), ("ZenFlow", cfg.zero_optimization.zenflow is not None),
                         ("DeepCompile", cfg.compile.deepcompile)):
            if on:
                out.append(ConfigProblem("gradient_allreduce_op", f"'sum' is not supported with {name}; accepted "
                                         "there: 'mean'", "sum"))
    if not cfg.zero_optimization.compute_grad_norm and cfg.zero_stage not in (1, 2):
        out.append(ConfigProblem("zero_optimization.compute_grad_norm", "false is supported only with ZeRO stage 1 "
                                 f"or 2 (zero_optimization.stage is {cfg.zero_stage})", False))
    param_dtype = cfg.data_types.param_dtype
    if param_dtype is not None and param_dtype != cfg.precision:
        out.append(ConfigProblem("data_types.param_dtype", f"conflicts with the training precision "
                                 f"({cfg.precision}, from fp16/bf16.enabled): set the matching 'enabled' flag or "
                                 f"leave param_dtype out", param_dtype))
    return out


def find_problems(cfg: DeepSpeedConfig) -> list[ConfigProblem]:
    """Every cross-section problem of ``cfg`` (empty when the combination is runnable)."""
    return _precision(cfg) + _parallel(cfg) + _elasticity(cfg) + _reduction(cfg)


def check_compatibility(cfg: DeepSpeedConfig) -> None:
    """Raise ``ConfigError`` listing every cross-section problem of ``cfg``."""
    problems = find_problems(cfg)
    if problems and all(p.message.startswith(_ELASTIC_BATCH) for p in problems):
        raise ElasticityConfigError(problems)  # DeepSpeed's error type for batch keys beside elastic training
    if problems:
        raise ConfigError(problems)

"""Names, templates and default tuning spaces of the Autotuner (values as DeepSpeed 0.19.8 documents them)."""

from __future__ import annotations

from typing import Any

AUTOTUNING = "autotuning"
DS_CONFIG = "ds_config"
ZERO_OPTIMIZATION = "zero_optimization"
TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"

METRIC_LATENCY = "latency"
METRIC_THROUGHPUT = "throughput"
METRIC_FLOPS = "flops"
METRIC_FILE_KEYS = {METRIC_LATENCY: "latency", METRIC_THROUGHPUT: "throughput", METRIC_FLOPS: "FLOPS_per_gpu"}
"""Config ``metric`` (lower-cased) -> key of the engine's metric file."""

METRIC_PERCENT_DIFF_CONST = 0.05
"""A micro-batch size must beat the previous best by 5 % to count as an improvement (DeepSpeed's constant)."""

GLOBAL_TUNING_SPACE = "global"
TUNING_MICRO_BATCH_SIZE_PREFIX = "z"
PROFILE_MODEL_INFO = "profile_model_info"

METRICS_FILE = "metrics.json"
MODEL_INFO_FILE = "model_info.json"
EXP_FILE = "exp.json"
DS_CONFIG_FILE = "ds_config.json"
CMD_FILE = "cmd.txt"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
SUMMARY_FILE = "summary.txt"
OPTIMAL_CONFIG_FILE = "ds_config_optimal.json"
OPTIMAL_CMD_FILE = "cmd_optimal.txt"

EXP_TIMEOUT_ENV = "DS_AUTOTUNING_EXP_TIMEOUT"
"""Seconds one experiment may run before it is killed and recorded as failed (default below)."""
EXP_TIMEOUT_DEFAULT = 1800.0

DEFAULT_MIN_MEM_CONFIG: dict[str, Any] = {
    TRAIN_MICRO_BATCH_SIZE_PER_GPU: 1,
    ZERO_OPTIMIZATION: {"stage": 3},
    "memory_breakdown": False,
}
"""What the model-info profile run trains with: the least memory per rank."""

TEMPLATES: dict[int, dict[str, Any]] = {
    0: {ZERO_OPTIMIZATION: {"stage": 0}},
    1: {ZERO_OPTIMIZATION: {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}},
    2: {ZERO_OPTIMIZATION: {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                            "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                            "contiguous_gradients": False}},
    3: {ZERO_OPTIMIZATION: {"stage": 3, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                            "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                            "contiguous_gradients": False, "stage3_max_live_parameters": 1e9,
                            "stage3_max_reuse_distance": 1e9, "stage3_prefetch_bucket_size": 5e8,
                            "stage3_param_persistence_threshold": 1e6,
                            "stage3_gather_16bit_weights_on_model_save": False, "sub_group_size": 1e12}},
}
"""Per-stage starting configs of an experiment (DeepSpeed's ``config_templates/template_zero<N>.json``)."""

DEFAULT_TUNING_SPACES: dict[int, dict[str, Any]] = {
    0: {ZERO_OPTIMIZATION: {"stage": 0}},
    1: {ZERO_OPTIMIZATION: {"stage": 1, "reduce_bucket_size": [5e7, 5e8, 1e9],
                            "allgather_bucket_size": [5e7, 5e8, 1e9]}},
    2: {ZERO_OPTIMIZATION: {"stage": 2, "overlap_comm": [True, False], "reduce_scatter": [False, True],
                            "reduce_bucket_size": [5e7, 5e8, 1e9], "allgather_bucket_size": [5e7, 5e8, 1e9],
                            "contiguous_gradients": [False, True]}},
    3: {ZERO_OPTIMIZATION: {"stage": 3, "overlap_comm": [True, False], "reduce_scatter": [False, True],
                            "reduce_bucket_size": [5e7, 5e8, 1e9], "allgather_partitions": [True, False],
                            "allgather_bucket_size": [5e7, 5e8, 1e9], "contiguous_gradients": [False, True]}},
}
"""The knobs tuned per ZeRO stage outside ``fast`` mode: a list value is a tuning parameter."""

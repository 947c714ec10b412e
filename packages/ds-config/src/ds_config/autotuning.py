"""``autotuning`` section: the DeepSpeed Autotuner's search settings."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from ds_config._base import DSConfigModel
from ds_config._types import Bool, PosInt


class ModelInfoConfig(DSConfigModel):
    """``autotuning.model_info``: model facts that let the tuner skip profiling."""

    profile: Bool = False
    num_params: PosInt | None = None
    hidden_size: PosInt | None = None
    num_layers: PosInt | None = None


class AutotuningConfig(DSConfigModel):
    """``autotuning``: which experiments the Autotuner runs and how it ranks them."""

    enabled: Bool = False
    """Enable autotuning."""
    results_dir: str = "autotuning_results"
    """Directory for experiment results (relative to the launch directory)."""
    exps_dir: str = "autotuning_exps"
    """Directory for experiment descriptions."""
    overwrite: Bool = False
    """Re-run experiments whose results already exist."""
    metric: Literal["latency", "throughput", "FLOPS", "flops"] = "throughput"
    """Metric ranking the experiments: ``latency``, ``throughput`` or ``FLOPS``."""
    metric_path: str | None = None
    """Where the engine writes an experiment's metrics (set by the Autotuner; default ``autotuning_metric.json``)."""
    start_profile_step: PosInt = 3
    """Global step at which profiling starts (after warm-up)."""
    end_profile_step: PosInt = 5
    """Global step at which profiling ends (>= ``start_profile_step``)."""
    fast: Bool = True
    """Tune only ZeRO stages and micro batch sizes."""
    max_train_batch_size: PosInt | None = None
    """Upper bound of the global batch of the tuned configurations (None: no bound)."""
    min_train_batch_size: PosInt = 1
    """Read by DeepSpeed but never used by its autotuner (nor here)."""
    max_train_micro_batch_size_per_gpu: PosInt = 1024
    """Largest micro batch size per rank tried."""
    min_train_micro_batch_size_per_gpu: PosInt = 1
    """Fallback micro batch size when the user's does not run."""
    mp_size: PosInt = 1
    """Model-parallel size of the tuned job."""
    num_tuning_micro_batch_sizes: PosInt = 3
    """Micro batch sizes tried per ZeRO stage."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "model_based"
    """Search algorithm."""
    tuner_early_stopping: PosInt = 5
    """Experiments run beyond the current best before stopping."""
    tuner_num_trials: PosInt = 50
    """Most experiments per tuning space."""
    arg_mappings: dict[str, str] | None = None
    """Maps DeepSpeed config keys to the training script's command-line arguments."""
    model_info: ModelInfoConfig | None = None
    """Model facts; ``num_params`` given skips the profile run, ``profile: true`` marks the profile run."""
    model_info_path: str | None = None
    """Where the profile run writes the model info (set by the Autotuner)."""

    @model_validator(mode="after")
    def _profile_window(self) -> AutotuningConfig:
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(f"end_profile_step ({self.end_profile_step}) must not be less than "
                             f"start_profile_step ({self.start_profile_step})")
        return self

"""The micro-batch-size half of the search (DeepSpeed's ``fast`` mode): per ZeRO stage, find the smallest and
largest micro-batch size that run, pick a few sizes between them and measure each.

A mixin of :class:`~deepspeed.autotuning.autotuner.Autotuner`; it uses the tuner's config accessors, its
resource manager and its records.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from deepspeed.autotuning.constants import (
    AUTOTUNING,
    GRADIENT_ACCUMULATION_STEPS,
    METRIC_PERCENT_DIFF_CONST,
    TRAIN_BATCH_SIZE,
    TRAIN_MICRO_BATCH_SIZE_PER_GPU,
    TUNING_MICRO_BATCH_SIZE_PREFIX,
    ZERO_OPTIMIZATION,
)
from deepspeed.autotuning.scheduler import ExperimentResult, is_better
from deepspeed.autotuning.utils import tuning_micro_batch_sizes
from ds_config import ConfigError

logger = logging.getLogger("deepspeed.launcher.autotuning")


class MicroBatchSearch:
    """Micro-batch-size experiments; ``self`` is an ``Autotuner``."""

    user_config: dict
    records: dict[str, list[ExperimentResult]]

    # ---- one experiment -------------------------------------------------------------------------------
    def base_config(self: Any, stage: int) -> dict:
        """The user's config with every list (a set of candidates) replaced by its first value, the ZeRO stage
        set to ``stage``, and no batch sizes (each experiment sets them)."""
        config = _first_values(copy.deepcopy(self.user_config))
        zero = config.get(ZERO_OPTIMIZATION)
        config[ZERO_OPTIMIZATION] = {**(zero if isinstance(zero, dict) else {}), "stage": stage}
        for key in (TRAIN_BATCH_SIZE, TRAIN_MICRO_BATCH_SIZE_PER_GPU, GRADIENT_ACCUMULATION_STEPS):
            config.pop(key, None)
        section = {k: v for k, v in (self.user_config.get(AUTOTUNING) or {}).items()
                   if k not in ("results_dir", "exps_dir", "model_info", "model_info_path", "metric_path")}
        config[AUTOTUNING] = {**section, "enabled": True}
        return config

    def set_batch(self: Any, config: dict, mbs: int, gas: int) -> dict:
        """Micro batch ``mbs``, ``gas`` accumulation steps, and the global batch that follows from the ranks."""
        config[TRAIN_MICRO_BATCH_SIZE_PER_GPU] = mbs
        config[GRADIENT_ACCUMULATION_STEPS] = gas
        config[TRAIN_BATCH_SIZE] = mbs * gas * self.exp_num_gpus * self.exp_num_nodes // self.mp_size()
        return config

    def run_ds_config(self: Any, ds_config: dict, exp_name: str) -> tuple[dict, float | None]:
        """Run one experiment (or reuse this session's run of the same name); returns (exp, metric value)."""
        result = self._session_results.get(exp_name)
        if result is None:
            exp = {"name": exp_name, "ds_config": ds_config, "num_gpus": self.exp_num_gpus,
                   "num_nodes": self.exp_num_nodes, "hostfile": self.args.hostfile}
            result = self.rm.run([exp])[0]
            self._session_results[exp_name] = result
        return result.exp, result.value(self.metric())

    def run_mbs(self: Any, stage: int, mbs: int, gas: int) -> float | None:
        """Measure ``mbs`` x ``gas`` at ``stage``, recorded in the space ``z<stage>``; the metric or None."""
        space = f"{TUNING_MICRO_BATCH_SIZE_PREFIX}{stage}"
        name = f"{space}_gas{gas}_tmbspg{mbs}"
        known = self._session_results.get(name)
        config = self.set_batch(self.base_config(stage), mbs, gas)
        _, value = self.run_ds_config(config, name)
        if known is None:
            self.update_records(space, self._session_results[name])
        return value

    # ---- the user's own config (the baseline) ---------------------------------------------------------
    def baseline_setting(self: Any) -> tuple[int, int, int]:
        """(ZeRO stage, micro batch, accumulation steps) of the user's config as DeepSpeed would run it without
        tuning: a list's first value, the stage 0 default for ``"all"`` or no stage, the micro batch from
        ``train_batch_size`` when only that is given."""
        stage = (self.user_config.get(ZERO_OPTIMIZATION) or {}).get("stage", 0)
        stage = stage[0] if isinstance(stage, list) and stage else stage
        stage = 0 if stage == "all" else int(stage)
        gas = self.get_gas_from_user_config()
        mbs = self.user_config.get(TRAIN_MICRO_BATCH_SIZE_PER_GPU)
        mbs = mbs[0] if isinstance(mbs, list) and mbs else mbs
        total = self.user_config.get(TRAIN_BATCH_SIZE)
        if not isinstance(mbs, int) and isinstance(total, int) and not isinstance(total, bool):
            mbs = max(total * self.mp_size() // (gas * self.exp_num_gpus * self.exp_num_nodes), 1)
        elif not isinstance(mbs, int) or isinstance(mbs, bool):
            mbs = self._user_micro_batch_size()
        return stage, mbs, gas

    def run_baseline(self: Any) -> float | None:
        """Measure the user's own config, so the optimum is chosen among candidates that include it (and the
        summary can say how much tuning gained); recorded in its stage's space like any micro-batch run."""
        stage, mbs, gas = self.baseline_setting()
        self.baseline_name = f"{TUNING_MICRO_BATCH_SIZE_PREFIX}{stage}_gas{gas}_tmbspg{mbs}"
        logger.info("measuring the user's config (the baseline): %s", self.baseline_name)
        return self.run_mbs(stage, mbs, gas)

    def baseline_result(self: Any) -> ExperimentResult | None:
        return self._session_results.get(self.baseline_name) if self.baseline_name else None

    # ---- the micro-batch range ------------------------------------------------------------------------
    def get_min_max_micro_batch_size(self: Any, stage: int, min_micro_batch_size: int,
                                     calculated_max_micro_batch_size: int) -> tuple[int, int]:
        """The smallest and largest micro-batch sizes that run at ``stage`` with the user's accumulation steps,
        ``(-1, -1)`` when none does. ``min_micro_batch_size`` > 0 (a lower stage's largest) is where to start;
        the largest is probed at the memory/configured cap first, then by bisection."""
        if min_micro_batch_size > calculated_max_micro_batch_size:
            return -1, -1
        gas = self.get_gas_from_user_config()
        cap = self.max_train_micro_batch_size_per_gpu()
        if min_micro_batch_size < 1:
            mbs = min(self._user_micro_batch_size(), cap)
            if self.run_mbs(stage, mbs, gas) is None:
                logger.info("micro batch size %d does not run at ZeRO stage %d", mbs, stage)
                fallback = self.min_train_micro_batch_size_per_gpu()
                if fallback == mbs or self.run_mbs(stage, fallback, gas) is None:
                    return -1, -1
                mbs = fallback
            min_micro_batch_size = mbs
        elif self.run_mbs(stage, min_micro_batch_size, gas) is None:
            return -1, -1
        high = min(calculated_max_micro_batch_size, cap)
        if high <= min_micro_batch_size or self.run_mbs(stage, high, gas) is not None:
            return min_micro_batch_size, max(high, min_micro_batch_size)
        low, high, best = min_micro_batch_size + 1, high - 1, min_micro_batch_size
        while low <= high:  # the largest size that still runs (fails above it: out of memory)
            mid = (low + high) // 2
            if self.run_mbs(stage, mid, gas) is not None:
                best, low = mid, mid + 1
            else:
                high = mid - 1
        return min_micro_batch_size, best

    def get_tuning_micro_batch_size_list(self: Any, min_micro_batch_size: int, max_micro_batch_size: int,
                                         num_tuning_micro_batch_sizes: int) -> tuple[list[int], int]:
        """(micro-batch sizes to measure, the per-rank batch every size is accumulated up to)."""
        if min_micro_batch_size <= 0 or max_micro_batch_size <= 0:
            return [], 0
        if self.max_train_batch_size():
            per_gpu = self.max_train_batch_size() * self.mp_size() // (self.exp_num_gpus * self.exp_num_nodes)
        else:
            per_gpu = max_micro_batch_size * self.get_gas_from_user_config() // self.mp_size()
        per_gpu = max(per_gpu, max_micro_batch_size)
        return tuning_micro_batch_sizes(min_micro_batch_size, max_micro_batch_size, num_tuning_micro_batch_sizes,
                                        per_gpu), per_gpu

    def run_tuning_micro_batch_sizes(self: Any, sizes: list[int], max_train_batch_size_per_gpu: int,
                                     min_micro_batch_size: int, stage: int, overwritten: bool) -> list[int]:
        """Measure every size in ``sizes`` (gradient accumulation up to ``max_train_batch_size_per_gpu``).

        Unless the user listed the sizes, also try a few smaller sizes with the largest size's accumulation
        steps, from the top down, while each beats the previous by 5 %: the largest size runs close to the
        memory limit and is not always the fastest. The best of them replaces the largest in the returned list.
        """
        sizes = sorted(sizes)
        values = {mbs: self.run_mbs(stage, mbs, max(1, max_train_batch_size_per_gpu // mbs)) for mbs in sizes}
        if overwritten:
            return sizes
        top = sizes[-1]
        floor = sizes[-2] + 1 if len(sizes) > 1 else min_micro_batch_size
        best_mbs, best_value = top, values[top]
        for mbs in reversed(range(floor, top, max((top - floor) // 3, 1))):
            value = self.run_mbs(stage, mbs, max(1, max_train_batch_size_per_gpu // mbs))
            if value is None or not _clearly_better(value, best_value, self.metric()):
                break
            best_mbs, best_value = mbs, value
        sizes[-1] = best_mbs
        return sorted(set(sizes))

    # ---- user values ----------------------------------------------------------------------------------
    def validate_user_batch(self: Any) -> None:
        """The batch keys the search reads: a positive integer, ``"auto"`` or (micro batch, accumulation steps)
        a non-empty list of positive integers; anything else would be dropped silently."""
        for key in (TRAIN_MICRO_BATCH_SIZE_PER_GPU, GRADIENT_ACCUMULATION_STEPS, TRAIN_BATCH_SIZE):
            if key not in self.user_config:
                continue
            value = self.user_config[key]
            values = value if isinstance(value, list) and key != TRAIN_BATCH_SIZE else [value]
            if not values or not all(v == "auto" or _positive_int(v) for v in values):
                lists = "" if key == TRAIN_BATCH_SIZE else " or a non-empty list of positive integers"
                raise ConfigError(f"autotuning accepts a positive integer, 'auto'{lists}", path=key, value=value)

    def get_gas_from_user_config(self: Any) -> int:
        """The user's gradient accumulation steps (an int, or ``"auto"`` read through ``arg_mappings``), else 1."""
        value = self.user_config.get(GRADIENT_ACCUMULATION_STEPS, 1)
        if value == "auto":
            value = self.get_val_from_user_args(GRADIENT_ACCUMULATION_STEPS) or 1
        if isinstance(value, list):
            logger.info("a list of %s is not tuned; using 1", GRADIENT_ACCUMULATION_STEPS)
            value = 1
        if not isinstance(value, int) and not (isinstance(value, str) and value.isdigit()) or int(value) < 1:
            raise ValueError(f"{GRADIENT_ACCUMULATION_STEPS} must be a positive integer, 'auto' or a list; "
                             f"got {value!r}")
        return int(value)

    def get_val_from_user_args(self: Any, ds_name: str) -> str | None:
        """The script argument mapped to config key ``ds_name`` by ``arg_mappings``, when numeric."""
        flag = (self.autotuning_config.arg_mappings or {}).get(ds_name)
        args = self.args.user_args
        if flag and flag in args and args.index(flag) + 1 < len(args) and args[args.index(flag) + 1].isdigit():
            return args[args.index(flag) + 1]
        return None

    def _user_micro_batch_size(self: Any) -> int:
        value = self.user_config.get(TRAIN_MICRO_BATCH_SIZE_PER_GPU)
        if isinstance(value, int) and not isinstance(value, bool):
            mbs = value
        else:  # absent or "auto" (Hugging Face): the script's argument, else 1
            mbs = int(self.get_val_from_user_args(TRAIN_MICRO_BATCH_SIZE_PER_GPU) or 1)
        if mbs < 1:
            raise ValueError(f"{TRAIN_MICRO_BATCH_SIZE_PER_GPU} must be >= 1, got {mbs}")
        return max(mbs, self.min_train_micro_batch_size_per_gpu())


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _clearly_better(value: float, than: float | None, metric: str) -> bool:
    """Better than ``than`` by more than ``METRIC_PERCENT_DIFF_CONST`` (5 %)."""
    if than is None:
        return True
    margin = abs(than) * METRIC_PERCENT_DIFF_CONST
    return is_better(value, than - margin if metric == "latency" else than + margin, metric)


def _first_values(config: dict) -> dict:
    """Lists of candidates -> their first value, at the top level and in ``zero_optimization`` (where the
    tuning parameters live); lists elsewhere (an optimizer's ``betas``) are values and stay."""
    out = {k: (v[0] if isinstance(v, list) and v else v) for k, v in config.items()}
    if isinstance(out.get(ZERO_OPTIMIZATION), dict):
        out[ZERO_OPTIMIZATION] = {k: (v[0] if isinstance(v, list) and v else v)
                                  for k, v in out[ZERO_OPTIMIZATION].items()}
    return out

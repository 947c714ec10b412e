"""``Autotuner``: finds the DeepSpeed configuration that trains the user's script fastest on the selected ranks.

``deepspeed --autotuning tune|run <script> ... --deepspeed_config ds.json`` builds one from the launcher's
arguments. The search (spec 12, the ``autotuning`` config section):

1. a model-info profile run (ZeRO-3, micro batch 1) records the parameter count, the activation memory of
   one sample and the memory per rank (skipped when ``autotuning.model_info.num_params`` is given);
2. for each ZeRO stage the user allows (``zero_optimization.stage``: a stage, a list, or ``"all"``/absent for
   0-3) whose model states fit in memory: the micro-batch sizes that run, then ``num_tuning_micro_batch_sizes``
   of them measured (``fast`` stops here); the user's own config (a list's first value, stage 0 for
   ``"all"``) is always one of the measured experiments: the baseline the summary compares the optimum with;
3. without ``fast``, for stages 1-3 that improved on the stage below: the stage's ZeRO knobs (bucket sizes,
   overlap, ...) times the measured sizes, explored by ``tuner_type`` (``gridsearch``, ``random``,
   ``model_based``) within ``tuner_num_trials`` and ``tuner_early_stopping``.

Each measurement is a real launcher job (see :mod:`.scheduler`); the engine writes the metric at
``end_profile_step``. Results: ``<results_dir>/<experiment>/``, ``summary.txt``, ``ds_config_optimal.json`` and
``cmd_optimal.txt``; experiment descriptions: ``<exps_dir>/<experiment>.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import shlex
import shutil
import subprocess
import time
from typing import Any

from deepspeed.autotuning._mbs_search import MicroBatchSearch
from deepspeed.autotuning.constants import (
    AUTOTUNING,
    DEFAULT_MIN_MEM_CONFIG,
    DEFAULT_TUNING_SPACES,
    DS_CONFIG,
    EXP_TIMEOUT_DEFAULT,
    EXP_TIMEOUT_ENV,
    GLOBAL_TUNING_SPACE,
    METRIC_LATENCY,
    OPTIMAL_CMD_FILE,
    OPTIMAL_CONFIG_FILE,
    PROFILE_MODEL_INFO,
    SUMMARY_FILE,
    TEMPLATES,
    TRAIN_MICRO_BATCH_SIZE_PER_GPU,
    ZERO_OPTIMIZATION,
)
from deepspeed.autotuning.scheduler import (
    ExperimentResult,
    ResourceManager,
    config_arg_index,
    is_better,
    split_equals,
    write_text,
)
from deepspeed.autotuning.tuner import GridSearchTuner, ModelBasedTuner, RandomTuner
from deepspeed.autotuning.utils import (
    canonical_name,
    get_all_configs,
    get_tuning_keys,
    instantiation_memory_per_gpu,
    memory_to_string,
    number_to_string,
    replace_dict,
)
from ds_config import AutotuningConfig, ConfigError, read_source, validate_section

logger = logging.getLogger("deepspeed.launcher.autotuning")

ALL_STAGES = (0, 1, 2, 3)


class Autotuner(MicroBatchSearch):
    """Tunes ZeRO stages, micro-batch sizes and ZeRO knobs for ``args`` (the ``deepspeed`` launcher's parsed
    arguments: ``user_script``, ``user_args`` with ``--deepspeed_config``, ``num_gpus``, ``num_nodes``, ...) on
    ``active_resources`` (``{host: [slot, ...]}``). Each experiment may run ``DS_AUTOTUNING_EXP_TIMEOUT``
    seconds (default 1800) before it is killed and recorded as failed."""

    def __init__(self, args: argparse.Namespace, active_resources: dict[str, list[int]], *,
                 from_hostfile: bool = False) -> None:
        if not active_resources or not all(active_resources.values()):
            raise ValueError(f"autotuning needs at least one rank on every node, got {active_resources!r}")
        self.args = args
        args.user_args = split_equals(list(args.user_args))
        self.user_config = self._get_user_config(args.user_args)
        self.autotuning_config: AutotuningConfig = validate_section(
            AutotuningConfig, self.user_config.get(AUTOTUNING) or {}, path=AUTOTUNING)
        self.user_zero_stages()  # bad stages and batch sizes are errors now, not after the profile run
        self.validate_user_batch()
        self.exps_dir = os.path.abspath(self.autotuning_config.exps_dir)
        self.results_dir = os.path.abspath(self.autotuning_config.results_dir)
        for key, folder in (("exps_dir", self.exps_dir), ("results_dir", self.results_dir)):
            if self.autotuning_config.overwrite:
                _check_removable(key, folder)
            if self.autotuning_config.overwrite and os.path.isdir(folder):
                shutil.rmtree(folder)
            os.makedirs(folder, exist_ok=True)
        self.rm = ResourceManager(args, active_resources, None, self.results_dir, self.exps_dir,
                                  self.autotuning_config.arg_mappings, _timeout_s(),
                                  self.autotuning_config.overwrite, from_hostfile)
        self.exp_num_nodes, self.exp_num_gpus = self._get_exp_resources(args)
        self.records: dict[str, list[ExperimentResult]] = {}
        self._session_results: dict[str, ExperimentResult] = {}
        self.baseline_name: str | None = None
        self.model_info: dict | None = None
        self.gpu_mem: float | None = None
        self.activation_mem: float | None = None
        self.optimal_cmd: list[str] | None = None
        self.optimal_ds_config: dict | None = None
        self.start_time = time.time()

    # ---- inputs ---------------------------------------------------------------------------------------
    def _get_user_config(self, user_args: list[str]) -> dict:
        """The DeepSpeed config file named in the script arguments (``--deepspeed_config`` or ``--deepspeed``)."""
        index = config_arg_index(user_args)
        if index is None:
            raise ValueError("autotuning needs the DeepSpeed config file in the script arguments: "
                             "--deepspeed_config <file.json> (or --deepspeed <file.json>)")
        path = user_args[index]
        if not os.path.isfile(path):
            raise ValueError(f"--deepspeed_config {path!r}: no such file")
        config = read_source(path)
        if not isinstance(config, dict):
            raise ValueError(f"--deepspeed_config {path!r}: expected a JSON object, got {type(config).__name__}")
        return config

    def _get_exp_resources(self, args: argparse.Namespace) -> tuple[int, int]:
        """(nodes, ranks per node) of every experiment: ``--num_nodes``/``--num_gpus`` or all selected."""
        nodes = args.num_nodes if args.num_nodes > 0 else len(self.rm.nodes)
        gpus = args.num_gpus if args.num_gpus > 0 else self.rm.num_gpus_per_node
        if gpus > self.rm.num_gpus_per_node or nodes > len(self.rm.nodes):
            raise ValueError(f"autotuning experiments need {nodes} node(s) x {gpus} rank(s) but only "
                             f"{len(self.rm.nodes)} x {self.rm.num_gpus_per_node} are selected")
        return nodes, gpus

    def metric(self) -> str:
        """``latency``, ``throughput`` or ``flops``."""
        return self.autotuning_config.metric.lower()

    def fast_enabled(self) -> bool:
        return self.autotuning_config.fast

    def max_train_batch_size(self) -> int | None:
        return self.autotuning_config.max_train_batch_size

    def mp_size(self) -> int:
        return self.autotuning_config.mp_size

    def max_train_micro_batch_size_per_gpu(self) -> int:
        """The configured cap, lowered so one micro batch per rank stays within ``max_train_batch_size``."""
        cap = self.autotuning_config.max_train_micro_batch_size_per_gpu
        if self.max_train_batch_size():
            per_gpu = self.max_train_batch_size() * self.mp_size() // (self.exp_num_gpus * self.exp_num_nodes)
            cap = min(cap, max(per_gpu, 1))
        return cap

    def min_train_micro_batch_size_per_gpu(self) -> int:
        return self.autotuning_config.min_train_micro_batch_size_per_gpu

    def num_tuning_micro_batch_sizes(self) -> int:
        return self.autotuning_config.num_tuning_micro_batch_sizes

    def fp16_enabled(self) -> bool:
        fp16 = self.user_config.get("fp16")
        return bool(isinstance(fp16, dict) and fp16.get("enabled", False))

    # ---- model info -----------------------------------------------------------------------------------
    def get_model_num_params(self) -> int | None:
        return (self.model_info or {}).get("num_params")

    def get_activation_memory_per_gpu(self) -> float | None:
        return (self.model_info or {}).get("activation_mem_per_gpu")

    def get_gpu_memory_info(self) -> float | None:
        """Memory per rank in bytes, as the profile run measured it (None when not profiled)."""
        return (self.model_info or {}).get("gpu_mem")

    def get_instantiation_memory_required_per_gpu(self, zero_stage: int) -> float:
        num_params = self.get_model_num_params()
        if not num_params:
            return 0.0
        return instantiation_memory_per_gpu(num_params, zero_stage, self.exp_num_gpus * self.exp_num_nodes,
                                            self.mp_size(), self.fp16_enabled())

    def model_info_profile_run(self) -> dict | None:
        """The model's facts: from ``autotuning.model_info`` when it gives ``num_params``, else from a profile
        run (ZeRO-3, micro batch 1) that writes ``<results_dir>/profile_model_info/model_info.json``:
        ``num_params``, ``trainable_num_params``, ``activation_mem_per_gpu`` (bytes saved for backward by one
        micro batch's forward) and ``gpu_mem`` (memory per rank). When ZeRO-3 does not run (an optimizer it
        was not tested with, ...), the profile is taken once more at the lowest stage the user allows
        (``profile_model_info_z<stage>``). None when no profile run succeeds."""
        given = self.autotuning_config.model_info
        if given is not None and given.num_params:
            return given.model_dump(exclude_none=True, exclude={"profile"})
        fallback = min(self.user_zero_stages())
        for stage, name in ((3, PROFILE_MODEL_INFO), (fallback, f"{PROFILE_MODEL_INFO}_z{fallback}")):
            config = self.base_config(stage)
            replace_dict(config, {k: v for k, v in DEFAULT_MIN_MEM_CONFIG.items() if k != ZERO_OPTIMIZATION})
            self.set_batch(config, 1, 1)
            config[AUTOTUNING] = {**config[AUTOTUNING], "model_info": {"profile": True}}
            exp = {"name": name, "ds_config": config, "num_gpus": self.exp_num_gpus,
                   "num_nodes": self.exp_num_nodes, "hostfile": self.args.hostfile}
            logger.info("starting the model info profile run (ZeRO stage %d)", stage)
            result = self.rm.run([exp])[0]
            if not result.error:
                return result.metrics
            logger.error("the model info profile run at ZeRO stage %d failed: %s; see %s", stage, result.error,
                         os.path.join(result.exp["result_dir"], "stderr.log"))
            if stage == fallback:
                break
        return None

    # ---- the search -----------------------------------------------------------------------------------
    def user_zero_stages(self) -> list[int]:
        """Stages to try: ``zero_optimization.stage`` as an int, a list, or ``"all"`` (also when absent)."""
        stage = (self.user_config.get(ZERO_OPTIMIZATION) or {}).get("stage", "all")
        stages = list(ALL_STAGES) if stage == "all" else (stage if isinstance(stage, list) else [stage])
        if "all" in stages:
            return list(ALL_STAGES)
        bad = [s for s in stages if isinstance(s, bool) or s not in ALL_STAGES]
        if bad or not stages:
            raise ConfigError("autotuning accepts a stage 0-3, a list of them or 'all'",
                              path="zero_optimization.stage", value=stage)
        return sorted(set(stages))

    def tune(self) -> None:
        """Run the search; the records end up in ``self.records`` (per tuning space)."""
        self.start_time = time.time()
        if self.fast_enabled():
            logger.info("fast mode: tuning ZeRO stages and micro batch sizes only")
        try:
            self.model_info = self.model_info_profile_run()
            if not self.model_info:
                return
            self.gpu_mem = self.get_gpu_memory_info()
            self.activation_mem = self.get_activation_memory_per_gpu()
            logger.info("the model has %s parameters; activation memory per sample %s; memory per rank %s",
                        number_to_string(self.get_model_num_params() or 0),
                        memory_to_string(self.activation_mem or 0), memory_to_string(self.gpu_mem or 0))
            self.run_baseline()
            max_mbs, best_mbs, best_val = 0, 0, None
            for stage in self.user_zero_stages():
                required = self.get_instantiation_memory_required_per_gpu(stage) + (self.activation_mem or 0)
                if self.gpu_mem and self.gpu_mem <= required:
                    logger.info("ZeRO stage %d needs %s per rank at micro batch 1, more than the %s available",
                                stage, memory_to_string(required), memory_to_string(self.gpu_mem))
                    continue
                next_max, next_mbs, next_val = self.tune_space(stage, max_mbs, best_mbs, best_val)
                if next_mbs > best_mbs or is_better(next_val, best_val, self.metric()):
                    max_mbs, best_mbs, best_val = max(next_max, max_mbs), next_mbs, next_val
        finally:
            self.rm.close()

    def _calculated_max_mbs(self, stage: int) -> int:
        """Micro batch that fits in memory at ``stage`` (the configured cap when memory is not known)."""
        cap = self.autotuning_config.max_train_micro_batch_size_per_gpu
        if not self.gpu_mem or not self.activation_mem:
            return cap
        free = self.gpu_mem - self.get_instantiation_memory_required_per_gpu(stage)
        return max(int(free // self.activation_mem), 0)

    def tune_space(self, stage: int, prev_max_mbs: int = 0, prev_best_mbs: int = 0,
                   prev_best_metric_val: float | None = None) -> tuple[int, int, float | None]:
        """Tune one ZeRO stage; returns (largest micro batch that runs, best micro batch, best metric)."""
        calculated = self._calculated_max_mbs(stage)
        if calculated < prev_max_mbs:
            logger.info("ZeRO stage %d fits no larger micro batch than stage below; skipped", stage)
            return 0, 0, None
        user_mbs = self.user_config.get(TRAIN_MICRO_BATCH_SIZE_PER_GPU)
        overwritten = isinstance(user_mbs, list)
        if overwritten:  # the user's list replaces the search for sizes
            sizes = sorted({int(s) for s in user_mbs if isinstance(s, int) and s > 0})
            low = sizes[0] if sizes else 0
            per_gpu = (sizes[-1] if sizes else 0) * self.get_gas_from_user_config()
        else:
            low, high = self.get_min_max_micro_batch_size(stage, prev_max_mbs, calculated)
            if high <= 0 or high < prev_max_mbs:
                return 0, 0, None
            sizes, per_gpu = self.get_tuning_micro_batch_size_list(low, high, self.num_tuning_micro_batch_sizes())
        if not sizes:
            return 0, 0, None
        logger.info("ZeRO stage %d: micro batch sizes %s, accumulated to %d per rank", stage, sizes, per_gpu)
        sizes = self.run_tuning_micro_batch_sizes(sizes, per_gpu, low, stage, overwritten)
        space = f"z{stage}"
        fast_best = self.get_best_space_record(space)
        best_mbs = fast_best[0][DS_CONFIG][TRAIN_MICRO_BATCH_SIZE_PER_GPU] if fast_best else 0
        best_val = fast_best[1] if fast_best else None
        if self.fast_enabled() or stage == 0:
            return max(sizes), best_mbs, best_val
        if best_mbs <= prev_best_mbs and not is_better(best_val, prev_best_metric_val, self.metric()):
            logger.info("ZeRO stage %d does not improve on the stage below; its knobs are not tuned", stage)
            return max(sizes), best_mbs, best_val
        full_best = self._tune_knobs(stage, sizes, per_gpu)
        if full_best and is_better(full_best[1], best_val, self.metric()):
            best_mbs, best_val = full_best[0][DS_CONFIG][TRAIN_MICRO_BATCH_SIZE_PER_GPU], full_best[1]
        return max(sizes), best_mbs, best_val

    def _tune_knobs(self, stage: int, sizes: list[int], per_gpu: int) -> tuple[dict, float, int] | None:
        """The stage's ZeRO knobs x ``sizes``, explored by the configured tuner; the space's best record."""
        space = copy.deepcopy(DEFAULT_TUNING_SPACES[stage])
        user_zero = self.user_config.get(ZERO_OPTIMIZATION) or {}
        space[ZERO_OPTIMIZATION].update({k: v for k, v in user_zero.items() if k != "stage"})
        space[TRAIN_MICRO_BATCH_SIZE_PER_GPU] = sizes
        name = canonical_name(space, get_tuning_keys(space), prefix=f"z{stage}_", omit_val=True)
        exps = self._generate_experiments(space, per_gpu)
        tuner_type = self.autotuning_config.tuner_type
        if tuner_type == "model_based":
            tuner = ModelBasedTuner(exps, self.rm, self.metric(), space)
        elif tuner_type == "random":
            tuner = RandomTuner(exps, self.rm, self.metric())
        else:
            tuner = GridSearchTuner(exps, self.rm, self.metric())
        tuner.tune(sample_size=1, n_trials=self.autotuning_config.tuner_num_trials,
                   early_stopping=self.autotuning_config.tuner_early_stopping)
        for result in tuner.results:
            self.update_records(name, result)
        return self.get_best_space_record(name)

    def _generate_experiments(self, tuning_space: dict, max_train_batch_size_per_gpu: int) -> list[dict]:
        """One experiment per configuration of ``tuning_space`` (lists are the tuned values), each on the stage's
        template and the user's other settings, accumulating to ``max_train_batch_size_per_gpu`` per rank."""
        stage = tuning_space[ZERO_OPTIMIZATION]["stage"]
        template = copy.deepcopy(TEMPLATES[stage])
        hidden = (self.model_info or {}).get("hidden_size")
        if stage == 3 and hidden:  # buckets sized to the layers (DeepSpeed's rule)
            template[ZERO_OPTIMIZATION].update(reduce_bucket_size=hidden * hidden,
                                               stage3_prefetch_bucket_size=0.9 * hidden * hidden,
                                               stage3_param_persistence_threshold=10 * hidden)
        keys = get_tuning_keys(tuning_space)
        exps = []
        for combo in get_all_configs(tuning_space):
            config = replace_dict(replace_dict(self.base_config(stage), template), combo)
            mbs = config[TRAIN_MICRO_BATCH_SIZE_PER_GPU]
            self.set_batch(config, mbs, max(1, max_train_batch_size_per_gpu // mbs))
            exps.append({"name": canonical_name(config, keys, prefix=f"z{stage}_"), DS_CONFIG: config,
                         "num_gpus": self.exp_num_gpus, "num_nodes": self.exp_num_nodes,
                         "hostfile": self.args.hostfile})
        return exps

    # ---- records --------------------------------------------------------------------------------------
    def update_records(self, space_name: str, result: ExperimentResult) -> None:
        self.records.setdefault(space_name, []).append(result)

    def get_best_space_record(self, space_name: str) -> tuple[dict, float, int] | None:
        """(best experiment, its metric, experiments in the space) of ``space_name``; None without a success."""
        best: ExperimentResult | None = None
        for result in self.records.get(space_name, []):
            if is_better(result.value(self.metric()), best.value(self.metric()) if best else None, self.metric()):
                best = result
        if best is None:
            return None
        return best.exp, best.value(self.metric()), len(self.records[space_name])

    def get_best_space_records(self) -> dict[str, tuple[dict, float, int]]:
        """Best record per space, plus the overall best under ``"global"``."""
        out: dict[str, tuple[dict, float, int]] = {}
        for space in self.records:
            record = self.get_best_space_record(space)
            if record:
                out[space] = record
                current = out.get(GLOBAL_TUNING_SPACE)
                if is_better(record[1], current[1] if current else None, self.metric()):
                    out[GLOBAL_TUNING_SPACE] = record
        if GLOBAL_TUNING_SPACE in out:  # listed last, with every experiment counted
            best = out.pop(GLOBAL_TUNING_SPACE)
            out[GLOBAL_TUNING_SPACE] = (*best[:2], sum(len(v) for v in self.records.values()))
        return out

    def print_tuning_results(self) -> str:
        """Print (and write to ``<results_dir>/summary.txt``) the best experiment per space and every
        experiment's outcome; returns the text."""
        best = self.get_best_space_records()
        rows = [(space, n, _fmt(val), exp["name"]) for space, (exp, val, n) in best.items()]
        text = _table(("tuning_space", "num_experiments", f"best_{self.metric()}", "best_exp_name"), rows)
        every = [(r.name + (" (baseline)" if r.name == self.baseline_name else ""), space,
                  "failed" if r.error else "ok", _fmt(r.value(self.metric())), r.error or "")
                 for space, results in self.records.items() for r in results]
        text += "\n\n" + _table(("experiment", "space", "status", self.metric(), "error"), every)
        duration = datetime.timedelta(seconds=round(time.time() - self.start_time))
        if GLOBAL_TUNING_SPACE in best:
            text += (f"\n\n{best[GLOBAL_TUNING_SPACE][0]['name']} is the optimal setup "
                     f"(results in {best[GLOBAL_TUNING_SPACE][0]['result_dir']}).")
            text += "\n" + self._baseline_line(best[GLOBAL_TUNING_SPACE][1])
        else:
            text += "\n\nNo experiment succeeded: see the stderr.log of each experiment under " + self.results_dir
        text += f"\nTuning completed in {duration}. Total number of experiments: {self.rm.experiment_count}.\n"
        print(text, flush=True)
        write_text(os.path.join(self.results_dir, SUMMARY_FILE), text)
        return text

    def _baseline_line(self, optimal: float) -> str:
        """The summary line comparing the optimum with the user's own config (``speedup`` > 1: faster)."""
        result = self.baseline_result()
        if result is None:
            return "baseline (the user's config): not measured"
        value = result.value(self.metric())
        if value is None or value == 0:
            return f"baseline (the user's config): {result.name} failed ({result.error or 'no metric'})"
        speedup = (value / optimal if optimal else float("inf")) if self.metric() == METRIC_LATENCY \
            else optimal / value
        return (f"baseline (the user's config): {result.name}, {self.metric()} {_fmt(value)}; "
                f"optimal/baseline {self.metric()} ratio {optimal / value:.3f} (speedup {speedup:.3f}x)")

    def write_optimal_config(self) -> str | None:
        """Write ``ds_config_optimal.json`` (the best experiment's config without its ``autotuning`` section)
        and ``cmd_optimal.txt`` (the user's command with that config) to ``results_dir``; returns the config
        path, or None when no experiment succeeded."""
        best = self.get_best_space_records().get(GLOBAL_TUNING_SPACE)
        if best is None:
            return None
        exp = best[0]
        ds_config = copy.deepcopy(exp[DS_CONFIG])
        ds_config.pop(AUTOTUNING, None)
        config_path = os.path.join(self.results_dir, OPTIMAL_CONFIG_FILE)
        write_text(config_path, json.dumps(ds_config, indent=2))
        job = {**exp, "exp_id": 0}  # the user's own --master_port
        cmd = self.rm.command(job, config_path)
        write_text(os.path.join(self.results_dir, OPTIMAL_CMD_FILE), shlex.join(cmd) + "\n")
        self.optimal_cmd, self.optimal_ds_config = cmd, ds_config
        logger.info("wrote the optimal DeepSpeed configuration to %s and its command to %s", config_path,
                    os.path.join(self.results_dir, OPTIMAL_CMD_FILE))
        return config_path

    def run_after_tuning(self) -> int:
        """Launch the user's job with the optimal configuration; returns its exit code."""
        if not self.optimal_cmd:
            logger.error("no optimal DeepSpeed configuration was found; nothing to run")
            return 1
        logger.info("running the job with the optimal configuration: %s", shlex.join(self.optimal_cmd))
        return subprocess.run(self.optimal_cmd, check=False).returncode


def _check_removable(key: str, folder: str) -> None:
    """``overwrite`` deletes the results folders: refuse one that holds the launch directory or is a home or
    filesystem root (``results_dir: "."`` would delete the user's project)."""
    cwd = os.path.realpath(os.getcwd())
    real = os.path.realpath(folder)
    protected = {os.path.realpath(os.path.expanduser("~")), os.path.realpath(os.sep)}
    if real in protected or cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        raise ConfigError("with overwrite: true the folder is deleted first; it must not be the launch directory, "
                          "one above it, the home directory or the filesystem root",
                          path=f"{AUTOTUNING}.{key}", value=folder)


def _timeout_s() -> float:
    raw = os.environ.get(EXP_TIMEOUT_ENV)
    if raw is None:
        return EXP_TIMEOUT_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{EXP_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.6g}"


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    """A pipe table (what DeepSpeed prints with tabulate), without the dependency."""
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)

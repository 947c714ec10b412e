"""Experiments as real launcher jobs: each one is ``python -m deepspeed.launcher.runner ... <user script>`` with the
experiment's config file, its own result folder and a time limit.

Layout (as DeepSpeed writes it): ``<exps_dir>/<name>.json`` describes the experiment; ``<results_dir>/<name>/``
holds ``ds_config.json``, ``exp.json`` (the description plus status, error and duration), ``cmd.txt``,
``stdout.log``, ``stderr.log`` and what the engine wrote: ``metrics.json`` (or ``model_info.json`` for the
model-info profile run). Experiments run one after another: on the ranks they share, two at once would time
each other. A failed or timed-out experiment is recorded (``status: failed`` with the error) and skipped.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deepspeed.autotuning.constants import (
    AUTOTUNING,
    CMD_FILE,
    DS_CONFIG,
    DS_CONFIG_FILE,
    EXP_FILE,
    METRIC_FILE_KEYS,
    METRIC_LATENCY,
    METRICS_FILE,
    MODEL_INFO_FILE,
    STDERR_FILE,
    STDOUT_FILE,
)
from deepspeed.autotuning.utils import get_val_by_key, is_number

logger = logging.getLogger("deepspeed.autotuning")

_PASS_THROUGH_FLAGS = ("module", "no_python", "no_local_rank", "bind_cores_to_rank", "no_ssh_check")
_PASS_THROUGH_VALUES = ("bind_core_list", "launcher", "launcher_args", "ssh_port")


def metric_value(metrics: dict | None, metric: str) -> float | None:
    """The value of ``metric`` (``latency``, ``throughput``, ``flops``/``FLOPS``) in a metric file's dict."""
    if not metrics:
        return None
    value = metrics.get(METRIC_FILE_KEYS[metric.lower()])
    return float(value) if is_number(value) else None


def is_better(value: float | None, than: float | None, metric: str) -> bool:
    """Whether ``value`` ranks above ``than`` for ``metric`` (lower latency, higher throughput/FLOPS; a missing
    value ranks last)."""
    if value is None:
        return False
    if than is None:
        return True
    return value < than if metric.lower() == METRIC_LATENCY else value > than


@dataclass
class ExperimentResult:
    """One finished experiment: its description, the engine's metric (or model-info) dict, or its error."""

    exp: dict
    metrics: dict | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return self.exp["name"]

    def value(self, metric: str) -> float | None:
        return None if self.error else metric_value(self.metrics, metric)


def _active_resources(hosts: Mapping[str, list[int]] | Iterable[str] | str,
                      num_gpus_per_node: int | None) -> dict[str, list[int]]:
    if isinstance(hosts, Mapping):
        resources = {str(h): list(slots) for h, slots in hosts.items()}
    else:
        names = [h.strip() for h in hosts.split(",")] if isinstance(hosts, str) else [str(h).strip() for h in hosts]
        if isinstance(num_gpus_per_node, bool) or not isinstance(num_gpus_per_node, int) or num_gpus_per_node < 1:
            raise ValueError(f"ResourceManager: num_gpus_per_node={num_gpus_per_node!r} must be a positive integer "
                             "when hosts are given by name")
        resources = {h: list(range(num_gpus_per_node)) for h in names if h}
    if not resources or not all(resources.values()):
        raise ValueError(f"ResourceManager: hosts={hosts!r} names no host with a slot; expected {{host: [slot, ...]}}"
                         " or host names with num_gpus_per_node")
    return resources


class ResourceManager:
    """Runs experiments on the selected ranks: ``run(exps)`` launches each (or reuses a finished result when
    ``overwrite`` is off) and returns their results.

    DeepSpeed's positional signature: ``hosts`` is either the active resources ``{host: [slot, ...]}`` (the
    autotuner passes these) or DeepSpeed's list of host names (a comma-separated string too), each then holding
    slots ``0 .. num_gpus_per_node - 1``. ``timeout_s`` bounds one experiment (None: no limit)."""

    def __init__(self, args: argparse.Namespace, hosts: Mapping[str, list[int]] | Iterable[str] | str,
                 num_gpus_per_node: int | None, results_dir: str, exps_dir: str,
                 arg_mappings: dict[str, str] | None, timeout_s: float | None = None, overwrite: bool = True,
                 from_hostfile: bool = False) -> None:
        self.args = args
        active_resources = _active_resources(hosts, num_gpus_per_node)
        self.nodes = list(active_resources)
        self.active_resources = active_resources
        self.num_gpus_per_node = min(len(slots) for slots in active_resources.values())
        self.results_dir, self.exps_dir = results_dir, exps_dir
        self.arg_mappings = {k.strip(): v.strip() for k, v in (arg_mappings or {}).items()}
        self.timeout_s, self.overwrite, self.from_hostfile = timeout_s, overwrite, from_hostfile
        self.experiment_count = 0
        self._bar: Any = None

    # ---- running --------------------------------------------------------------------------------------
    def run(self, exps: list[dict]) -> list[ExperimentResult]:
        """Run ``exps`` in order; one progress-bar tick per experiment."""
        bar = self._progress(len(exps))
        results = []
        for exp in exps:
            result = self._cached(exp) or self._launch(exp)
            results.append(result)
            if bar is not None:
                bar.set_postfix_str(f"{result.name}: {'failed' if result.error else 'ok'}")
                bar.update(1)
            if result.error:
                logger.warning("experiment %s failed (%s); see %s", result.name, result.error,
                               os.path.join(result.exp["result_dir"], STDERR_FILE))
        return results

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _progress(self, n: int) -> Any:
        """One bar over every experiment of the tuning session; its total grows as the search adds batches."""
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is optional: the per-experiment log lines remain
            return None
        if self._bar is None:
            self._bar = tqdm(total=n, desc="autotuning experiments", unit="exp", file=sys.stderr,
                             dynamic_ncols=True)
        else:
            self._bar.total += n
            self._bar.refresh()
        return self._bar

    def _prepare(self, exp: dict) -> dict:
        exp = copy.deepcopy(exp)
        exp["exp_id"] = self.experiment_count
        self.experiment_count += 1
        result_dir = os.path.abspath(os.path.join(self.results_dir, exp["name"]))
        exp["result_dir"] = result_dir
        section = exp[DS_CONFIG].setdefault(AUTOTUNING, {})
        section["enabled"] = True
        if section.get("model_info", {}).get("profile"):
            section["model_info_path"] = os.path.join(result_dir, MODEL_INFO_FILE)
            exp["output_file"] = section["model_info_path"]
        else:
            section["metric_path"] = os.path.join(result_dir, METRICS_FILE)
            exp["output_file"] = section["metric_path"]
        _write_json(os.path.join(self.exps_dir, f"{exp['name']}.json"), exp)
        return exp

    def _cached(self, exp: dict) -> ExperimentResult | None:
        """A finished result of the same experiment (same name and config), unless ``overwrite``."""
        path = os.path.join(os.path.abspath(os.path.join(self.results_dir, exp["name"])), EXP_FILE)
        if self.overwrite or not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as handle:
                old = json.load(handle)
        except (OSError, ValueError):
            return None
        if old.get("status") not in ("ok", "failed") or old.get("job") != self.job_key(exp) or \
                _without_paths(old.get(DS_CONFIG)) != _without_paths(exp[DS_CONFIG]):
            return None  # another config, script, argument list or rank count: measure it afresh
        logger.info("reusing the result of experiment %s (overwrite is off)", exp["name"])
        if old["status"] == "failed":
            return ExperimentResult(old, error=old.get("error") or "failed")
        return ExperimentResult(old, metrics=_read_json(old["output_file"]))

    def _launch(self, exp: dict) -> ExperimentResult:
        exp = self._prepare(exp)
        exp["job"] = self.job_key(exp)
        result_dir = exp["result_dir"]
        os.makedirs(result_dir, exist_ok=True)
        for stale in (exp["output_file"],):
            if os.path.exists(stale):
                os.remove(stale)
        config_path = os.path.join(result_dir, DS_CONFIG_FILE)
        _write_json(config_path, exp[DS_CONFIG])
        exp["ds_config_path"] = config_path
        cmd = self.command(exp, config_path)
        exp["cmd"] = cmd
        write_text(os.path.join(result_dir, CMD_FILE), shlex.join(cmd) + "\n")
        exp["status"] = "running"
        _write_json(os.path.join(result_dir, EXP_FILE), exp)
        logger.info("launching experiment %d: %s", exp["exp_id"], exp["name"])
        started = time.perf_counter()
        rc, error = self._execute(cmd, result_dir)
        exp["duration_s"] = round(time.perf_counter() - started, 3)
        exp["returncode"] = rc
        metrics = _read_json(exp["output_file"])
        if error is None and metrics is None:
            steps = exp[DS_CONFIG][AUTOTUNING].get("end_profile_step", 5)
            error = (f"finished without writing {os.path.basename(exp['output_file'])} (the script must train "
                     f"past autotuning.end_profile_step: at least {steps + 1} steps)")
        exp["status"], exp["error"] = ("failed", error) if error else ("ok", None)
        _write_json(os.path.join(result_dir, EXP_FILE), exp)
        return ExperimentResult(exp, metrics=None if error else metrics, error=error)

    def _execute(self, cmd: list[str], result_dir: str) -> tuple[int | None, str | None]:
        """Run ``cmd`` in its own session (so a timeout kills the launcher and all its ranks); returns
        (exit code, error or None)."""
        with open(os.path.join(result_dir, STDOUT_FILE), "wb") as out, \
                open(os.path.join(result_dir, STDERR_FILE), "wb") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
            try:
                rc = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return None, f"timed out after {self.timeout_s:g} s"
            except BaseException:  # KeyboardInterrupt: leave no ranks behind
                _kill_group(proc)
                raise
        if rc != 0:
            return rc, f"exit code {rc}: {last_error_line(os.path.join(result_dir, STDERR_FILE))}"
        return rc, None

    def job_key(self, exp: dict) -> dict:
        """What besides the config decides a measurement: script, its arguments (config path masked) and ranks."""
        return {"user_script": self.args.user_script, "user_args": self.user_args(exp[DS_CONFIG], "<config>"),
                "num_gpus": exp["num_gpus"], "num_nodes": exp["num_nodes"]}

    # ---- the command ----------------------------------------------------------------------------------
    def command(self, exp: dict, config_path: str) -> list[str]:
        """The launcher command of ``exp``: its resources, a port of its own, the user's script and arguments
        with ``--deepspeed_config`` pointing at ``config_path`` and ``arg_mappings`` applied."""
        return (self.launcher_args(exp) + [self.args.user_script]
                + self.user_args(exp[DS_CONFIG], config_path))

    def launcher_args(self, exp: dict) -> list[str]:
        args = self.args
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
        hosts = self.nodes[: exp["num_nodes"]]
        if self.from_hostfile:
            include = "@".join(f"{h}:{','.join(map(str, self.active_resources[h][: exp['num_gpus']]))}"
                               for h in hosts)
            cmd += ["--hostfile", args.hostfile, "--include", include]
        else:
            cmd += ["--num_gpus", str(exp["num_gpus"])]
        cmd += ["--master_port", str(args.master_port + exp.get("exp_id", 0))]
        if len(hosts) > 1 and args.master_addr:
            cmd += ["--master_addr", args.master_addr]
        cmd += [f"--{flag}" for flag in _PASS_THROUGH_FLAGS if getattr(args, flag, False)]
        for name in _PASS_THROUGH_VALUES:
            value = getattr(args, name, None)
            if value not in (None, "", _default(name)):
                cmd.append(f"--{name}={value}")
        return cmd

    def user_args(self, ds_config: dict, config_path: str) -> list[str]:
        out = list(self.args.user_args)
        index = config_arg_index(out)
        if index is None:
            raise ValueError("autotuning needs the DeepSpeed config file in the script arguments: "
                             "--deepspeed_config <file.json> (or --deepspeed <file.json>)")
        out[index] = config_path
        for key, flag in self.arg_mappings.items():
            value = get_val_by_key(ds_config, key)
            if value is None or str(value) == "auto":
                continue
            if flag in out and out.index(flag) + 1 < len(out):
                out[out.index(flag) + 1] = str(value)
            else:
                out += [flag, str(value)]
        return out


def config_arg_index(user_args: list[str]) -> int | None:
    """Index of the config path in the script arguments: after ``--deepspeed_config``, or after
    ``--deepspeed`` when a ``.json`` follows it (Hugging Face's form); ``--flag=path`` forms are split first."""
    for flag in ("--deepspeed_config", "--deepspeed"):
        if flag in user_args:
            i = user_args.index(flag) + 1
            if i < len(user_args) and (flag == "--deepspeed_config" or user_args[i].endswith(".json")):
                return i
    return None


def split_equals(user_args: list[str]) -> list[str]:
    """``--deepspeed_config=x.json`` -> ``--deepspeed_config x.json`` (other arguments unchanged)."""
    out: list[str] = []
    for arg in user_args:
        if arg.startswith(("--deepspeed_config=", "--deepspeed=")):
            out += arg.split("=", 1)
        else:
            out.append(arg)
    return out


def last_error_line(stderr_path: str) -> str:
    """The last line of ``stderr_path`` that names an error (a traceback's last line), else its last line."""
    try:
        with open(stderr_path, encoding="utf-8", errors="replace") as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError:
        return "no stderr.log"
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(no output)"])[-1][:500]


def _default(name: str) -> Any:
    return {"launcher": "pdsh", "launcher_args": ""}.get(name)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _without_paths(ds_config: dict | None) -> dict | None:
    """``ds_config`` as an experiment runs it, minus the output paths (they differ only by the results folder)."""
    if ds_config is None:
        return None
    out = copy.deepcopy(ds_config)
    section = out.setdefault(AUTOTUNING, {})
    section["enabled"] = True
    for key in ("metric_path", "model_info_path"):
        section.pop(key, None)
    return out


def write_text(path: str, text: str) -> None:
    """Atomic write (GUIDE 9): a temporary name, fsync, rename; a reader never sees half a file. Not
    ``runtime.checkpointing._atomic``: importing that package loads torch, and the launcher side stays torch-free."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _write_json(path: str, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2))


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

"""The Autotuner's search logic, tuners, cost model and result files, with experiments simulated in-process
(a fake resource manager scores each config), plus the launcher-job runner's timeout and the engine-side probe
on 2 gloo ranks. The real ``deepspeed --autotuning`` run is in ``test_autotuning_e2e.py``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import pytest
import torch
from _harness import run_distributed

from deepspeed.autotuning import Autotuner
from deepspeed.autotuning.constants import DS_CONFIG
from deepspeed.autotuning.scheduler import ExperimentResult, ResourceManager, config_arg_index, is_better
from deepspeed.autotuning.tuner import GridSearchTuner, ModelBasedTuner, RandomTuner
from deepspeed.autotuning.tuner.cost_model import RidgeCostModel
from deepspeed.autotuning.utils import (
    canonical_name,
    get_all_configs,
    get_tuning_keys,
    instantiation_memory_per_gpu,
    replace_dict,
    tuning_micro_batch_sizes,
)
from ds_config import ConfigError


# ---- helpers -------------------------------------------------------------------------------------------
def _args(config_path: str, **over) -> argparse.Namespace:
    base = dict(user_script="train.py", user_args=["--deepspeed", "--deepspeed_config", config_path],
                num_gpus=-1, num_nodes=-1, hostfile="/job/hostfile", master_port=29500, master_addr="127.0.0.1")
    base.update(over)
    return argparse.Namespace(**base)


class FakeRM:
    """Scores a config with ``score(ds_config)`` (None: the experiment fails) instead of launching it."""

    def __init__(self, score, metric="throughput"):
        self.score, self.metric, self.ran, self.experiment_count = score, metric, [], 0

    def run(self, exps):
        out = []
        for exp in exps:
            self.ran.append(exp["name"])
            self.experiment_count += 1
            exp = {**exp, "result_dir": f"/results/{exp['name']}"}
            value = self.score(exp[DS_CONFIG])
            if value is None:
                out.append(ExperimentResult(exp, error="exit code 1: out of memory"))
            elif exp["name"].startswith("profile_model_info"):
                out.append(ExperimentResult(exp, metrics=value))
            else:
                out.append(ExperimentResult(exp, metrics={self.metric: value, "FLOPS_per_gpu": value}))
        return out

    def close(self):
        pass

    def command(self, exp, config_path):
        return ["deepspeed", "train.py", "--deepspeed_config", config_path]


def _tuner(tmp_path, config: dict, score, profile=None, **args_over) -> tuple[Autotuner, FakeRM]:
    path = tmp_path / "ds.json"
    tmp_path.mkdir(parents=True, exist_ok=True)
    config.setdefault("autotuning", {})
    config["autotuning"].update(results_dir=str(tmp_path / "res"), exps_dir=str(tmp_path / "exps"))
    path.write_text(json.dumps(config))
    tuner = Autotuner(_args(str(path), **args_over), {"localhost": [0, 1]})
    info = {"num_params": 1000, "activation_mem_per_gpu": 1000, "gpu_mem": 10**9}

    def scored(cfg):
        if cfg["autotuning"].get("model_info"):
            return (profile or (lambda _: info))(cfg)
        return score(cfg)

    tuner.rm = FakeRM(scored, tuner.metric())
    return tuner, tuner.rm


def _mbs(cfg):
    return cfg["train_micro_batch_size_per_gpu"]


# ---- utils ---------------------------------------------------------------------------------------------
def test_defaults_are_the_documented_ones():
    """The ``autotuning`` section's documented defaults (config reference), as the Autotuner reads them."""
    from ds_config import AutotuningConfig

    documented = {"enabled": False, "results_dir": "autotuning_results", "exps_dir": "autotuning_exps",
                  "overwrite": False, "metric": "throughput", "start_profile_step": 3, "end_profile_step": 5,
                  "fast": True, "max_train_batch_size": None, "mp_size": 1, "num_tuning_micro_batch_sizes": 3,
                  "tuner_type": "model_based", "tuner_early_stopping": 5, "tuner_num_trials": 50,
                  "arg_mappings": None}
    assert AutotuningConfig().model_dump(include=set(documented)) == documented


def test_tuning_space_expansion_and_names():
    space = {"zero_optimization": {"stage": 1, "reduce_bucket_size": [5e7, 5e8], "overlap_comm": [True, False]},
             "train_micro_batch_size_per_gpu": [2, 4, 4], "optimizer": {"params": {"betas": [0.9, 0.99]}}}
    configs = get_all_configs(space)
    assert len(configs) == 2 * 2 * 2  # the repeated 4 is one config; optimizer betas are a value, not candidates
    assert all(c["optimizer"]["params"]["betas"] == [0.9, 0.99] for c in configs)
    keys = get_tuning_keys(space)
    assert keys == ["reduce_bucket_size", "overlap_comm", "train_micro_batch_size_per_gpu"]
    names = {canonical_name(c, keys, prefix="z1_") for c in configs}
    assert len(names) == len(configs) and "z1_rbs5e+07_oc1_mbs2" in names
    assert canonical_name(space, keys, prefix="z1_", omit_val=True) == "z1_rbs_oc_mbs"


def test_replace_dict_merges_and_deletes():
    target = {"a": 1, "zero": {"stage": 0, "x": 1}, "gone": 3}
    assert replace_dict(target, {"zero": {"stage": 2}, "gone": None, "b": [1]}) == \
        {"a": 1, "zero": {"stage": 2, "x": 1}, "b": [1]}


def test_micro_batch_list_follows_deepspeeds_rule():
    # from max//2 in 3 strides; sizes with the same accumulation steps as the largest are dropped
    assert tuning_micro_batch_sizes(1, 16, 3, 16) == [8, 16]
    assert tuning_micro_batch_sizes(1, 16, 3, 64) == [8, 10, 12, 16]  # 14 needs 4 steps, as 16 does
    assert tuning_micro_batch_sizes(0, 16, 3, 16) == []


def test_instantiation_memory_shrinks_with_stage():
    full = instantiation_memory_per_gpu(10**6, 0, 4, 1, fp16=False)
    assert full == 10**6 * (4 + 4 + 8)
    assert instantiation_memory_per_gpu(10**6, 1, 4, 1, False) == 10**6 * (4 + 4 + 8 / 4)
    assert instantiation_memory_per_gpu(10**6, 3, 4, 2, True) == 10**6 * (2 + 2 + 16) / 4 / 2


def test_metric_direction_and_config_argument():
    assert is_better(1.0, 2.0, "latency") and not is_better(1.0, 2.0, "throughput")
    assert is_better(3.0, None, "flops") and not is_better(None, 1.0, "throughput")
    assert config_arg_index(["--deepspeed", "--deepspeed_config", "a.json"]) == 2
    assert config_arg_index(["--deepspeed", "b.json"]) == 1
    assert config_arg_index(["--deepspeed"]) is None


# ---- tuners and the cost model -------------------------------------------------------------------------
def _space_exps(values):
    return [{"name": f"e{v}", DS_CONFIG: {"train_micro_batch_size_per_gpu": v}} for v in values]


def test_grid_search_runs_in_order_and_stops_early():
    rm = FakeRM(lambda c: 100.0 - _mbs(c))  # the first is best: stop after early_stopping more
    tuner = GridSearchTuner(_space_exps(range(1, 21)), rm, "throughput")
    assert tuner.tune(n_trials=50, early_stopping=3) == 4
    assert rm.ran == ["e1", "e2", "e3", "e4"] and tuner.best_exp["name"] == "e1"


def test_random_tuner_is_seeded_and_skips_failures():
    def order(seed):
        rm = FakeRM(lambda c: None if _mbs(c) == 5 else float(_mbs(c)))
        tuner = RandomTuner(_space_exps(range(1, 9)), rm, "throughput", seed=seed)
        tuner.tune(n_trials=100)
        return rm.ran, tuner

    first, tuner = order(3)
    assert first == order(3)[0] and sorted(first) == sorted(f"e{i}" for i in range(1, 9))
    assert first != [f"e{i}" for i in range(1, 9)] or first != order(4)[0]
    assert tuner.best_exp["name"] == "e8" and any(r.error for r in tuner.results)


def test_latency_metric_picks_the_smallest():
    rm = FakeRM(lambda c: float(_mbs(c)), metric="latency")
    tuner = GridSearchTuner(_space_exps([4, 2, 8]), rm, "latency")
    tuner.tune()
    assert tuner.best_exp["name"] == "e2" and tuner.best_metric_val == 2.0


def test_cost_model_fits_a_quadratic():
    xs = [[float(x)] for x in range(-5, 6)]
    ys = [10 - (x[0] - 1.5) ** 2 for x in xs]
    model = RidgeCostModel(alpha=1e-8)
    model.fit(xs, ys)
    pred = model.predict([[1.5], [4.0]])
    assert pred[0] == pytest.approx(10, abs=1e-3) and pred[1] == pytest.approx(10 - 6.25, abs=1e-3)
    with pytest.raises(ValueError, match="alpha"):
        RidgeCostModel(alpha=-1)


def test_model_based_tuner_finds_the_peak_with_fewer_runs():
    space = {"train_micro_batch_size_per_gpu": list(range(1, 41))}
    exps = [{"name": f"e{v}", DS_CONFIG: {"train_micro_batch_size_per_gpu": v}} for v in range(1, 41)]
    rm = FakeRM(lambda c: 1000.0 - (math.log2(_mbs(c)) - math.log2(20)) ** 2 * 100)
    tuner = ModelBasedTuner(exps, rm, "throughput", space, seed=0)
    ran = tuner.tune(n_trials=40, early_stopping=6)
    assert tuner.best_exp["name"] in {"e19", "e20", "e21"}
    assert ran < 20  # a grid search would need 20 runs to reach e20


# ---- the search ----------------------------------------------------------------------------------------
def test_fast_search_over_stages_and_micro_batches(tmp_path, monkeypatch):
    """Stage 1 is fastest; micro batches above 12 fail (out of memory); the bisection finds 12."""
    def score(cfg):
        mbs, stage = _mbs(cfg), cfg["zero_optimization"]["stage"]
        if mbs > 12:
            return None
        return mbs * {0: 10.0, 1: 12.0}[stage] * cfg["gradient_accumulation_steps"] ** 0.1

    tuner, rm = _tuner(tmp_path, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": [0, 1]},
                                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                                  "autotuning": {"fast": True, "max_train_batch_size": 64}}, score)
    tuner.tune()
    assert rm.ran[0] == "profile_model_info"
    z0 = [n for n in rm.ran if n.startswith("z0_")]
    assert "z0_gas1_tmbspg2" in z0 and "z0_gas1_tmbspg32" in z0  # the user's size, then the cap (64 / 2 ranks)
    assert "z0_gas1_tmbspg12" in z0 and "z0_gas1_tmbspg13" in z0  # bisection between them
    assert len(rm.ran) == len(set(rm.ran))  # no experiment runs twice
    assert any(r.error for r in tuner.records["z0"])  # failures are recorded, not fatal
    best = tuner.get_best_space_records()["global"]
    assert best[0]["name"].startswith("z1_") and best[0][DS_CONFIG]["train_micro_batch_size_per_gpu"] == 12
    assert list(tuner.get_best_space_records()) == ["z0", "z1", "global"]
    replaced = []  # every result file is written atomically (temporary name, then os.replace)
    monkeypatch.setattr(os, "replace", lambda src, dst, _real=os.replace: (replaced.append(dst), _real(src, dst)))
    path = tuner.write_optimal_config()
    tuner.print_tuning_results()
    assert {os.path.basename(p) for p in replaced} == {"ds_config_optimal.json", "cmd_optimal.txt", "summary.txt"}
    optimal = json.loads(open(path).read())
    assert "autotuning" not in optimal and optimal["zero_optimization"]["stage"] == 1
    assert optimal["train_batch_size"] == optimal["train_micro_batch_size_per_gpu"] * \
        optimal["gradient_accumulation_steps"] * 2
    cmd = (tmp_path / "res" / "cmd_optimal.txt").read_text()
    assert "ds_config_optimal.json" in cmd
    text = tuner.print_tuning_results()
    assert "global" in text and "failed" in text and (tmp_path / "res" / "summary.txt").read_text() == text


def test_full_search_tunes_zero_knobs_with_each_tuner(tmp_path):
    """Outside fast mode stage 1's buckets are tuned; the best bucket size is found by every tuner type."""
    for tuner_type in ("gridsearch", "random", "model_based"):
        def score(cfg):
            bucket = cfg["zero_optimization"].get("reduce_bucket_size", 5e8)
            return _mbs(cfg) * (2.0 if bucket == 5e7 else 1.0)

        tuner, rm = _tuner(tmp_path / tuner_type, {"train_micro_batch_size_per_gpu": [2, 4],
                                                   "zero_optimization": {"stage": 1},
                                                   "autotuning": {"fast": False, "tuner_type": tuner_type,
                                                                  "tuner_early_stopping": 20}}, score)
        tuner.tune()
        knob_spaces = [s for s in tuner.records if s.startswith("z1_")]
        assert knob_spaces == ["z1_rbs_abs_mbs"], tuner_type
        best = tuner.get_best_space_records()["global"][0][DS_CONFIG]
        assert best["zero_optimization"]["reduce_bucket_size"] == 5e7 and _mbs(best) == 4, tuner_type


def test_latency_metric_and_model_info_from_config(tmp_path):
    """``model_info.num_params`` skips the profile run; ``latency`` keeps the smallest value."""
    tuner, rm = _tuner(tmp_path, {"train_micro_batch_size_per_gpu": [1, 2, 4], "zero_optimization": {"stage": 0},
                                  "autotuning": {"metric": "latency", "model_info": {"num_params": 10}}},
                       lambda cfg: float(_mbs(cfg)))
    tuner.tune()
    assert "profile_model_info" not in rm.ran and tuner.get_model_num_params() == 10
    assert tuner.get_best_space_records()["global"][0][DS_CONFIG]["train_micro_batch_size_per_gpu"] == 1


def test_profile_falls_back_to_the_lowest_stage(tmp_path):
    """ZeRO-3 fails (e.g. an optimizer it was not tested with): the profile is retaken at the lowest stage."""
    info = {"num_params": 5, "activation_mem_per_gpu": 10, "gpu_mem": 10**6}
    tuner, rm = _tuner(tmp_path, {"train_micro_batch_size_per_gpu": [1], "zero_optimization": {"stage": [1, 2]}},
                       lambda cfg: 1.0, profile=lambda cfg: None if cfg["zero_optimization"]["stage"] == 3 else info)
    tuner.tune()
    assert rm.ran[:2] == ["profile_model_info", "profile_model_info_z1"] and tuner.get_model_num_params() == 5
    assert {"z1", "z2"} <= set(tuner.records)
    tuner, rm = _tuner(tmp_path / "none", {"zero_optimization": {"stage": 3}}, lambda cfg: 1.0,
                       profile=lambda cfg: None)
    tuner.tune()
    assert rm.ran == ["profile_model_info"] and tuner.records == {}  # stage 3 is the lowest: no second try


def test_the_users_config_is_a_measured_baseline(tmp_path):
    """Stage 1 only searches micro batches above stage 0's largest (12), so the user's own setting (stage 1,
    micro 3) would not be measured; it is, as the baseline, and here it wins. The summary names it with the
    ratio of the optimum to it."""
    def score(cfg):
        mbs, stage = _mbs(cfg), cfg["zero_optimization"]["stage"]
        if mbs > 12:
            return None
        return 1000.0 if (stage, mbs) == (1, 3) else float(mbs)

    tuner, rm = _tuner(tmp_path, {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": [1, 0]},
                                  "autotuning": {"fast": True, "max_train_batch_size": 64}}, score)
    tuner.tune()
    assert rm.ran[1] == "z1_gas1_tmbspg3" and tuner.baseline_name == "z1_gas1_tmbspg3"
    assert tuner.baseline_setting() == (1, 3, 1)
    assert "z1_gas1_tmbspg12" in rm.ran and len(rm.ran) == len(set(rm.ran))
    assert tuner.get_best_space_records()["global"][0]["name"] == "z1_gas1_tmbspg3"
    text = tuner.print_tuning_results()
    assert "z1_gas1_tmbspg3 (baseline)" in text
    assert "baseline (the user's config): z1_gas1_tmbspg3, throughput 1000; optimal/baseline throughput " \
           "ratio 1.000 (speedup 1.000x)" in text


def test_baseline_ratio_follows_the_metric_and_failures(tmp_path):
    """Latency: lower is better, so the speedup is baseline/optimal; a failed baseline is reported, never best."""
    tuner, _ = _tuner(tmp_path / "lat", {"train_micro_batch_size_per_gpu": [4, 1, 2],
                                         "zero_optimization": {"stage": 0}, "autotuning": {"metric": "latency"}},
                      lambda cfg: float(_mbs(cfg)))
    tuner.tune()
    assert tuner.baseline_name == "z0_gas1_tmbspg4"
    assert "optimal/baseline latency ratio 0.250 (speedup 4.000x)" in tuner.print_tuning_results()
    tuner, _ = _tuner(tmp_path / "fail", {"train_micro_batch_size_per_gpu": [4, 1, 2],
                                          "zero_optimization": {"stage": 0}},
                      lambda cfg: None if _mbs(cfg) == 4 else float(_mbs(cfg)))
    tuner.tune()
    assert tuner.get_best_space_records()["global"][0]["name"] == "z0_gas2_tmbspg2"
    assert "baseline (the user's config): z0_gas1_tmbspg4 failed (exit code 1: out of memory)" in \
        tuner.print_tuning_results()


def test_baseline_setting_of_partial_configs(tmp_path):
    """Without a micro batch it follows from train_batch_size; "all" (or no stage) runs DeepSpeed's stage 0."""
    tuner, _ = _tuner(tmp_path, {"train_batch_size": 16, "gradient_accumulation_steps": 2,
                                 "zero_optimization": {"stage": "all"}}, lambda cfg: 1.0)
    assert tuner.baseline_setting() == (0, 4, 2)  # 16 / (2 steps x 2 ranks)
    tuner, _ = _tuner(tmp_path / "b", {}, lambda cfg: 1.0)
    assert tuner.baseline_setting() == (0, 1, 1)


def test_nothing_runs(tmp_path):
    tuner, _ = _tuner(tmp_path, {"zero_optimization": {"stage": 0}}, lambda cfg: None)
    tuner.tune()
    assert tuner.write_optimal_config() is None
    assert "No experiment succeeded" in tuner.print_tuning_results()


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="--deepspeed_config"):
        Autotuner(argparse.Namespace(user_script="t.py", user_args=["--lr", "1"], num_gpus=-1, num_nodes=-1,
                                     hostfile="", master_port=1), {"localhost": [0]})
    with pytest.raises(ValueError, match="no such file"):
        Autotuner(_args(str(tmp_path / "missing.json")), {"localhost": [0]})
    (tmp_path / "bad.json").write_text(json.dumps({"autotuning": {"metric": "speed"}}))
    with pytest.raises(ConfigError, match="autotuning.metric"):
        Autotuner(_args(str(tmp_path / "bad.json")), {"localhost": [0]})
    (tmp_path / "stage.json").write_text(json.dumps({"zero_optimization": {"stage": 5},
                                                     "autotuning": {"results_dir": str(tmp_path / "r")}}))
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        Autotuner(_args(str(tmp_path / "stage.json")), {"localhost": [0]}).user_zero_stages()
    for key, value in (("train_micro_batch_size_per_gpu", [2, "x"]), ("train_micro_batch_size_per_gpu", []),
                       ("gradient_accumulation_steps", 0), ("train_batch_size", True),
                       ("zero_optimization", {"stage": []}), ("zero_optimization", {"stage": [True]})):
        (tmp_path / "b.json").write_text(json.dumps({key: value, "autotuning": {"results_dir": str(tmp_path / "r")}}))
        path = key if key != "zero_optimization" else "zero_optimization.stage"
        with pytest.raises(ConfigError, match=path):
            Autotuner(_args(str(tmp_path / "b.json")), {"localhost": [0]})
    (tmp_path / "ok.json").write_text(json.dumps({"autotuning": {"results_dir": str(tmp_path / "r")}}))
    with pytest.raises(ValueError, match="rank"):
        Autotuner(_args(str(tmp_path / "ok.json"), num_gpus=4), {"localhost": [0, 1]})


def test_overwrite_refuses_to_delete_the_launch_directory(tmp_path, monkeypatch):
    """``overwrite`` deletes results_dir/exps_dir first: never the launch directory or a folder above it."""
    work = tmp_path / "project"
    (work / "keep").mkdir(parents=True)
    monkeypatch.chdir(work)
    for key, value in (("results_dir", "."), ("exps_dir", str(tmp_path))):
        (tmp_path / "c.json").write_text(json.dumps({"autotuning": {"overwrite": True, key: value}}))
        with pytest.raises(ConfigError, match=f"autotuning.{key}"):
            Autotuner(_args(str(tmp_path / "c.json")), {"localhost": [0]})
    assert (work / "keep").is_dir()
    (work / "autotuning_results" / "old").mkdir(parents=True)
    (tmp_path / "c.json").write_text(json.dumps({"autotuning": {"overwrite": True}}))
    Autotuner(_args(str(tmp_path / "c.json")), {"localhost": [0]})
    assert not (work / "autotuning_results" / "old").exists() and (work / "keep").is_dir()


# ---- launcher jobs -------------------------------------------------------------------------------------
def test_experiment_timeout_env_var_is_read_validated_and_documented(tmp_path, monkeypatch, capsys):
    """No config key documents a time limit: ``DS_AUTOTUNING_EXP_TIMEOUT`` sets it, and --help says so."""
    import deepspeed.autotuning as package
    from deepspeed.launcher.runner import parse_args

    (tmp_path / "ds.json").write_text(json.dumps({"autotuning": {"results_dir": str(tmp_path / "r"),
                                                                 "exps_dir": str(tmp_path / "e")}}))
    monkeypatch.setenv("DS_AUTOTUNING_EXP_TIMEOUT", "42.5")
    assert Autotuner(_args(str(tmp_path / "ds.json")), {"localhost": [0]}).rm.timeout_s == 42.5
    monkeypatch.delenv("DS_AUTOTUNING_EXP_TIMEOUT")
    assert Autotuner(_args(str(tmp_path / "ds.json")), {"localhost": [0]}).rm.timeout_s == 1800.0
    for bad in ("0", "soon"):
        monkeypatch.setenv("DS_AUTOTUNING_EXP_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"DS_AUTOTUNING_EXP_TIMEOUT='{bad}': expected a positive"):
            Autotuner(_args(str(tmp_path / "ds.json")), {"localhost": [0]})
    assert "DS_AUTOTUNING_EXP_TIMEOUT" in package.__doc__
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "DS_AUTOTUNING_EXP_TIMEOUT" in " ".join(capsys.readouterr().out.split())


def test_experiment_command_and_timeout(tmp_path):
    """The command carries the resources, a port per experiment, the config path and ``arg_mappings``; a job
    past its time limit is killed (with its ranks) and recorded as failed."""
    args = argparse.Namespace(user_script="bash", master_port=29990, master_addr="", hostfile="/job/hostfile",
                              user_args=["-c", "sleep 30", "--deepspeed_config", "x.json", "--mbs", "1"],
                              no_python=True, no_local_rank=True, module=False, bind_cores_to_rank=False,
                              no_ssh_check=False, launcher="pdsh", launcher_args="", bind_core_list=None,
                              ssh_port=None)
    rm = ResourceManager(args, {"localhost": [0, 1]}, None, str(tmp_path / "res"), str(tmp_path / "exps"),
                         {"train_micro_batch_size_per_gpu": "--mbs"}, timeout_s=2.0, overwrite=False)
    exp = {"name": "slow", DS_CONFIG: {"train_micro_batch_size_per_gpu": 8}, "num_gpus": 2, "num_nodes": 1}
    started = time.perf_counter()
    result = rm.run([exp])[0]
    assert time.perf_counter() - started < 20
    rm.close()
    assert result.error == "timed out after 2 s"
    cmd = result.exp["cmd"]
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert cmd[cmd.index("--num_gpus") + 1] == "2" and cmd[cmd.index("--master_port") + 1] == "29990"
    assert "--no_python" in cmd and cmd[cmd.index("--mbs") + 1] == "8"
    assert cmd[cmd.index("--deepspeed_config") + 1] == os.path.join(result.exp["result_dir"], "ds_config.json")
    saved = json.loads((tmp_path / "res" / "slow" / "exp.json").read_text())
    assert saved["status"] == "failed" and "timed out" in saved["error"]
    assert json.loads((tmp_path / "exps" / "slow.json").read_text())["name"] == "slow"
    # overwrite is off: the recorded failure is reused, nothing is launched again
    started = time.perf_counter()
    assert rm.run([exp])[0].error == saved["error"] and time.perf_counter() - started < 1
    # ... but not when the script's arguments changed (or the rank count): that is another measurement
    args.user_args[1] = "exit 3"
    assert rm.run([exp])[0].error.startswith("exit code 3")
    assert json.loads((tmp_path / "res" / "slow" / "exp.json").read_text())["job"]["user_args"][:2] == \
        ["-c", "exit 3"]
    hostfile_rm = ResourceManager(args, {"w0": [0, 1], "w1": [0, 1]}, None, str(tmp_path), str(tmp_path), None, 1.0,
                                  False, from_hostfile=True)
    launcher = hostfile_rm.launcher_args({"num_gpus": 1, "num_nodes": 2, "exp_id": 3})
    assert launcher[launcher.index("--include") + 1] == "w0:0@w1:0"
    assert launcher[launcher.index("--master_port") + 1] == "29993"


# ---- the engine-side probe -----------------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x).sum()


def _probe_body(mode: str, path: str) -> dict:
    import deepspeed

    torch.manual_seed(0)
    autotuning = {"enabled": True, "start_profile_step": 2, "end_profile_step": 3}
    if mode == "model_info":
        autotuning.update(model_info={"profile": True}, model_info_path=path)
    else:
        autotuning["metric_path"] = path
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "autotuning": autotuning}
    engine, *_ = deepspeed.initialize(model=_Net(), model_parameters=_Net().parameters(), config=config)
    forwards = 0
    try:
        for _ in range(40):
            loss = engine(torch.randn(4, 16))
            forwards += 1
            engine.backward(loss)
            engine.step()
    except SystemExit as exc:
        return {"code": exc.code, "forwards": forwards, "steps": engine.global_steps}
    return {"code": None, "forwards": forwards, "steps": engine.global_steps}


def test_disabled_autotuning_costs_the_engine_nothing():
    """Without ``autotuning.enabled`` no probe (no hooks) is attached, and importing the engine loads none of the
    search's modules."""
    import subprocess
    import types

    from deepspeed.autotuning.probe import attach_probe
    from ds_config import AutotuningConfig

    module = torch.nn.Linear(2, 2)
    assert attach_probe(types.SimpleNamespace(module=module), AutotuningConfig()) is None
    assert not module._forward_pre_hooks and not module._forward_hooks
    code = ("import sys, deepspeed.runtime.engine; "
            "print(sorted(m for m in sys.modules if m.startswith('deepspeed.autotuning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[-2] == "['deepspeed.autotuning', 'deepspeed.autotuning.probe']", out.stderr


def test_probe_writes_metrics_then_exits(tmp_path):
    path = str(tmp_path / "metrics.json")
    out = run_distributed(_probe_body, world_size=2, args=("metric", path), timeout=60)
    # steps 2..3 timed; the first forward of step 4 (after 3 steps of 2 micro-batches) counts flops and exits
    assert out == [{"code": 0, "forwards": 6, "steps": 3}] * 2
    metrics = json.loads(open(path).read())
    assert metrics["steps"] == 2 and metrics["train_batch_size"] == 16
    assert metrics["throughput"] == pytest.approx(16 / (metrics["latency"] / 1e3))
    assert 0 < metrics["cpu_latency"]
    forward_flops = 2 * 4 * (16 * 32 + 32 * 1)  # two matmuls of one micro batch
    step_flops = metrics["FLOPS_per_gpu"] * metrics["latency"] / 1e3
    assert step_flops == pytest.approx(3 * forward_flops * 2)


def test_probe_profiles_model_info(tmp_path):
    path = str(tmp_path / "model_info.json")
    out = run_distributed(_probe_body, world_size=2, args=("model_info", path), timeout=60)
    assert out == [{"code": 0, "forwards": 0, "steps": 0}] * 2  # exits inside the first forward
    info = json.loads(open(path).read())
    assert info["num_params"] == 16 * 32 + 32 + 32 + 1
    # saved for backward: the input (4 x 16) and the ReLU output (4 x 32), fp32; weights are not activations
    assert info["activation_mem_per_gpu"] == 4 * (16 + 32) * 4
    assert info["gpu_mem"] > 0

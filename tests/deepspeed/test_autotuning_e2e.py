"""``deepspeed --autotuning run`` end to end: real launcher jobs on 2 CPU ranks (gloo), a failing experiment
recorded and skipped, the documented result files, then the user's job launched with the optimal config."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent('''
    import argparse, json
    import torch
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--fail_mbs", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    args = deepspeed.add_config_arguments(parser).parse_args()
    with open(args.deepspeed_config) as handle:
        config = json.load(handle)
    if config["train_micro_batch_size_per_gpu"] == args.fail_mbs:
        raise RuntimeError("simulated out of memory")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        loss = engine(torch.randn(engine.train_micro_batch_size_per_gpu(), 16)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    if engine.global_rank == 0:
        print(f"FINISHED steps={engine.global_steps} mbs={engine.train_micro_batch_size_per_gpu()}", flush=True)
''')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_autotuning_run_end_to_end(tmp_path):
    (tmp_path / "train.py").write_text(_SCRIPT)
    config = {"train_micro_batch_size_per_gpu": [2, 3], "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 0},
              "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2, "fast": True}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_AUTOTUNING_EXP_TIMEOUT": "120"}
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
           "--autotuning", "run", "train.py", "--deepspeed", "--deepspeed_config", "ds.json", "--fail_mbs", "3"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results, exps = tmp_path / "autotuning_results", tmp_path / "autotuning_exps"
    info = json.loads((results / "profile_model_info" / "model_info.json").read_text())
    assert info["num_params"] == 16 * 32 + 32 + 32 + 1 and info["activation_mem_per_gpu"] > 0
    good, bad = results / "z0_gas1_tmbspg2", results / "z0_gas1_tmbspg3"
    for folder in (good, bad):
        assert {"ds_config.json", "exp.json", "cmd.txt", "stdout.log", "stderr.log"} <= set(os.listdir(folder))
        assert json.loads((exps / f"{folder.name}.json").read_text())["name"] == folder.name
    metrics = json.loads((good / "metrics.json").read_text())
    assert metrics["throughput"] > 0 and metrics["train_batch_size"] == 4 and metrics["steps"] == 2
    failed = json.loads((bad / "exp.json").read_text())
    assert failed["status"] == "failed" and "simulated out of memory" in failed["error"]

    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == 2 and optimal["train_batch_size"] == 4
    assert "autotuning" not in optimal
    assert str(results / "ds_config_optimal.json") in (results / "cmd_optimal.txt").read_text()
    summary = (results / "summary.txt").read_text()
    assert "z0_gas1_tmbspg2 is the optimal setup" in summary and "failed" in summary
    assert "autotuning experiments" in proc.stderr  # the progress bar over experiments
    # --autotuning run: the job ran to its end with the optimal config (no autotuning section: no early exit)
    assert "FINISHED steps=6 mbs=2" in proc.stdout + proc.stderr

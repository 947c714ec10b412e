"""Hugging Face Accelerate's own API (no Trainer) on our engine with ZeRO stages 1/2: two CPU ranks (gloo),
launched with the ``deepspeed`` launcher and with ``accelerate launch``.

On the CPU, Accelerate's ``PartialState`` only sets up the process group's size when it is told ``cpu=True``
(without it every rank believes it is alone and the batch arithmetic fails, as with DeepSpeed itself), while
``Accelerator(cpu=True)`` would drop DeepSpeed: so the scripts build ``PartialState(cpu=True)`` first and then
``Accelerator(deepspeed_plugin=...)``, which is what ``TrainingArguments(use_cpu=True)`` does for the Trainer.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.path.exists("/job/hostfile"), reason="a real /job/hostfile would be used")

_BIN = Path(sys.executable).parent
LAUNCHER = [str(_BIN / "deepspeed")] if (_BIN / "deepspeed").exists() else [sys.executable, "-m",
                                                                            "deepspeed.launcher.runner"]

PREAMBLE = textwrap.dedent("""
    import json, os
    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    setup = json.loads(os.environ["ACC_SETUP"])  # argv has the launcher's --local_rank
    PartialState(cpu=True)  # the process group over both ranks (gloo); then DeepSpeed on top of it
    X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    Y = torch.randn(64, 1, generator=torch.Generator().manual_seed(2))

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def loader():
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=4)

    def train(acc, model, opt, sched, dl, batches):
        losses, norms = [], []
        for i, (x, y) in enumerate(dl):
            if i == batches:
                break
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), 1.0))
                opt.step()
                if sched is not None:
                    sched.step()
                opt.zero_grad()
            losses.append(acc.gather(loss.detach().reshape(1)).tolist())
        return losses, norms

    def resume_round_trip(acc, model, opt, sched, dl, path):
        # save, train 4 batches, load, train them again: (same losses, same weights)
        acc.save_state(path)
        after, _ = train(acc, model, opt, sched, dl, 4)
        w_after = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
        acc.load_state(path)
        again, _ = train(acc, model, opt, sched, dl, 4)
        w_again = acc.get_state_dict(model)
        return after == again, all(torch.equal(w_after[k], w_again[k]) for k in w_after)

    def train_reference(reference):
        # the epoch's 4 steps in one process: each global batch is 2 micro batches x 2 ranks of 4 samples
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
        ref_norms = []
        for start in range(0, 64, 16):
            ref_opt.zero_grad()
            loss = sum(torch.nn.functional.mse_loss(reference(X[i:i + 4]), Y[i:i + 4])
                       for i in range(start, start + 16, 4)) / 4
            loss.backward()
            ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item())
            ref_opt.step()
        return ref_norms

    def report(acc, **values):
        if acc.is_main_process:
            print("RESULT " + json.dumps(values), flush=True)
        # destroys the process group: without it gloo's threads can abort the exiting interpreter (SIGABRT)
        acc.end_training()
""")

CLIENT = PREAMBLE + textwrap.dedent("""
    import copy
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=setup["stage"], gradient_accumulation_steps=2,
                                                       gradient_clipping=1.0))
    model = net()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt, dl = acc.prepare(model, opt, loader())
    losses, norms = train(acc, model, opt, None, dl, 16)  # the whole epoch: 4 optimizer steps

    ref_norms = train_reference(reference)
    weights = acc.get_state_dict(model)
    max_diff = max((weights[k] - v).abs().max().item() for k, v in reference.state_dict().items())

    out = setup["out"]
    losses_equal, weights_equal = resume_round_trip(acc, model, opt, None, dl, os.path.join(out, "state"))
    acc.wait_for_everyone()
    acc.save_model(model, os.path.join(out, "model"))
    report(acc, engine=type(model).__name__, zero_stage=model.zero_optimization_stage(), steps=model.global_steps,
           optimizer=type(opt).__name__, unwrapped=type(acc.unwrap_model(model)).__name__,
           processes=acc.num_processes, distributed=str(acc.distributed_type), max_diff=max_diff, norms=norms,
           ref_norms=ref_norms, resumed_losses_equal=losses_equal, resumed_weights_equal=weights_equal,
           state_files=sorted(os.listdir(os.path.join(out, "state"))),
           gathered=acc.gather(torch.tensor([acc.process_index])).tolist())
""")

DUMMY = PREAMBLE + textwrap.dedent("""
    from accelerate.utils import DummyOptim, DummyScheduler
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=setup["config"]))
    model = net()
    opt = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.0)
    sched = DummyScheduler(opt, warmup_num_steps=4)
    model, opt, sched, dl = acc.prepare(model, opt, sched, loader())
    lrs = []
    for i, (x, y) in enumerate(dl):
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            lrs.append(model.get_lr()[0])
        if i == 5:
            break
    losses_equal, weights_equal = resume_round_trip(acc, model, opt, sched, dl, os.path.join(setup["out"], "state"))
    report(acc, zero_stage=model.zero_optimization_stage(), basic=type(model.basic_optimizer).__name__,
           schedule=type(model.lr_scheduler).__name__, wrapper=type(sched).__name__, lrs=lrs,
           gas=model.gradient_accumulation_steps(), resumed_losses_equal=losses_equal,
           resumed_weights_equal=weights_equal)
""")

OFFLOAD_SCHEDULE = PREAMBLE + textwrap.dedent("""
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1,
                                                       offload_optimizer_device="cpu"))
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # built before prepare, as usual
    model, opt, sched, dl = acc.prepare(model, opt, sched, loader())
    train(acc, model, opt, sched, dl, 2)
    acc.save_state(os.path.join(setup["out"], "state"))
    acc.load_state(os.path.join(setup["out"], "state"))
    saved_lr = model.get_lr()[0]
    train(acc, model, opt, sched, dl, 2)
    report(acc, basic=type(model.basic_optimizer).__name__, saved_lr=saved_lr, engine_lr=model.get_lr()[0],
           schedule_lr=sched.get_last_lr()[0])
""")

ACCELERATE_LAUNCHED = textwrap.dedent("""
    import torch
    from accelerate import Accelerator, PartialState

    PartialState(cpu=True)
    acc = Accelerator()  # the DeepSpeed plugin comes from the config file, through the environment
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    model, opt, dl = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    for x, y in dl:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    if acc.is_main_process:
        import json
        print("RESULT " + json.dumps({"engine": type(model).__name__, "stage": model.zero_optimization_stage(),
                                      "processes": acc.num_processes, "distributed": str(acc.distributed_type),
                                      "steps": model.global_steps, "gas": model.gradient_accumulation_steps(),
                                      "clip": model.gradient_clipping()}), flush=True)
    acc.end_training()
""")

ACCELERATE_CONFIG = textwrap.dedent("""
    compute_environment: LOCAL_MACHINE
    distributed_type: DEEPSPEED
    deepspeed_config:
      zero_stage: 2
      gradient_accumulation_steps: 2
      gradient_clipping: 1.0
      offload_optimizer_device: none
      offload_param_device: none
      zero3_init_flag: false
    num_processes: 2
    num_machines: 1
    machine_rank: 0
    use_cpu: true
    mixed_precision: 'no'
    rdzv_backend: static
    same_network: true
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, setup: dict) -> dict:
    return {**os.environ, "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "ACC_SETUP": json.dumps(setup)}


def _result(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if "RESULT " in x)
    return json.loads(line.split("RESULT ", 1)[1])


def launch(tmp_path: Path, script: str, **setup) -> dict:
    (tmp_path / "train.py").write_text(script)
    setup.setdefault("out", str(tmp_path / "out"))
    done = subprocess.run(LAUNCHER + ["--num_gpus", "2", "--master_port", str(_free_port()), "train.py"],
                          cwd=tmp_path, env=_env(tmp_path, setup), capture_output=True, text=True, timeout=240)
    return _result(done)


def test_client_optimizer_zero2_matches_one_process_and_resumes(tmp_path):
    r = launch(tmp_path, CLIENT, stage=2)
    assert r["engine"] == "DeepSpeedEngine" and r["zero_stage"] == 2 and r["steps"] == 4 + 2  # the load restored step 4
    assert r["distributed"] == "DistributedType.DEEPSPEED" and r["processes"] == 2
    assert r["optimizer"] == "DeepSpeedOptimizerWrapper" and r["unwrapped"] == "Sequential"
    # accumulate (2 micro batches) + all-reduce over 2 ranks + clipping = one process on the 16-sample batch
    assert r["max_diff"] < 1e-6
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)  # clip_grad_norm_ = the engine's pre-clip norm
    assert r["resumed_losses_equal"] and r["resumed_weights_equal"]  # save_state / load_state round trip
    assert {"latest", "pytorch_model", "zero_to_fp32.py"} <= set(r["state_files"])
    assert r["gathered"] == [0, 1]
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()


def test_dummy_optim_and_scheduler_from_the_config_zero1(tmp_path):
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": 2,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto", "warmup_type": "linear"}}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    r = launch(tmp_path, DUMMY, config=str(tmp_path / "ds.json"))
    assert r["zero_stage"] == 1 and r["gas"] == 2
    assert r["basic"] == "FusedAdam" and r["schedule"] == "WarmupLR" and r["wrapper"] == "DeepSpeedSchedulerWrapper"
    # the engine steps WarmupLR once per optimizer step (Accelerate's wrapper adds none): after step k the linear
    # warm-up to 1e-2 over 4 steps is at iteration k - 1, so 1e-2 * (k - 1) / 4, as in DeepSpeed
    assert r["lrs"] == pytest.approx([0.0, 0.0025, 0.005])
    assert r["resumed_losses_equal"] and r["resumed_weights_equal"]


def test_accelerate_launch_with_a_deepspeed_config_file(tmp_path):
    (tmp_path / "train.py").write_text(ACCELERATE_LAUNCHED)
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_CONFIG)
    accelerate = [str(_BIN / "accelerate")] if (_BIN / "accelerate").exists() else [
        sys.executable, "-m", "accelerate.commands.accelerate_cli"]
    done = subprocess.run(accelerate + ["launch", "--config_file", "accelerate.yaml", "--main_process_port",
                                        str(_free_port()), "train.py"],
                          cwd=tmp_path, env=_env(tmp_path, {}), capture_output=True, text=True, timeout=240)
    r = _result(done)
    assert r["engine"] == "DeepSpeedEngine" and r["stage"] == 2 and r["processes"] == 2
    assert r["distributed"] == "DistributedType.DEEPSPEED"
    assert r["gas"] == 2 and r["clip"] == 1.0 and r["steps"] == 2  # 4 micro batches per rank / 2


def test_offload_with_a_torch_schedule_keeps_driving_the_lr_after_load_state(tmp_path):
    r = launch(tmp_path, OFFLOAD_SCHEDULE)
    assert r["basic"] == "DeepSpeedCPUAdam"
    # StepLR(gamma=0.5) is stepped twice per optimizer step (Accelerate steps it once per process)
    assert r["saved_lr"] == pytest.approx(1e-2 * 0.5 ** 4)
    assert r["engine_lr"] == pytest.approx(r["schedule_lr"]) and r["engine_lr"] == pytest.approx(1e-2 * 0.5 ** 8)

"""Hugging Face Trainer (through Accelerate) on our engine with ZeRO stages 1/2: a real two-rank launch with
the ``deepspeed`` launcher, the ``"auto"`` config values Transformers fills in, checkpoints in DeepSpeed's
layout, and a resume that continues bit for bit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(os.path.exists("/job/hostfile"), reason="a real /job/hostfile would be used")

_CONSOLE = Path(sys.executable).with_name("deepspeed")
LAUNCHER = [str(_CONSOLE)] if _CONSOLE.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]

TRAIN = textwrap.dedent("""
    import json, os
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    setup = json.loads(os.environ["HF_TRAINER_SETUP"])  # argv has the launcher's --local_rank
    zero = {"stage": setup["stage"], "overlap_comm": True, "contiguous_gradients": True}
    if setup.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
    }

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=setup["out"], per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=6, learning_rate=1e-3, warmup_steps=2, max_grad_norm=0.5, logging_steps=1,
                             save_strategy="steps", save_steps=3, deepspeed=ds_config, report_to=[], use_cpu=True,
                             bf16=setup.get("bf16", False))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    result = trainer.train(resume_from_checkpoint=setup.get("resume"))
    engine = trainer.model_wrapped
    if trainer.is_world_process_zero():
        print("RESULT " + json.dumps({
            "engine": type(engine).__name__, "stage": engine.zero_optimization_stage(),
            "optimizer": type(engine.optimizer).__name__, "steps": trainer.state.global_step,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "train_loss": result.training_loss}))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(tmp_path: Path, **setup) -> dict:
    (tmp_path / "train.py").write_text(TRAIN)
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_TRAINER_SETUP": json.dumps(setup)}
    done = subprocess.run(LAUNCHER + ["--num_gpus", "2", "--master_port", str(_free_port()), "train.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if "RESULT " in x)
    return json.loads(line.split("RESULT ", 1)[1])


def test_stage2_trains_saves_and_resumes_bit_for_bit(tmp_path):
    full = train(tmp_path, stage=2, out=str(tmp_path / "full"))
    assert full["engine"] == "DeepSpeedEngine" and full["stage"] == 2 and full["steps"] == 6
    assert full["optimizer"] == "DeepSpeedZeroOptimizer"
    assert len(full["losses"]) == 6 and all(loss == loss for loss in full["losses"])  # logged, finite
    step3 = tmp_path / "full" / "checkpoint-3"
    assert (step3 / "latest").read_text().strip() == "global_step3"
    assert sorted(p.name for p in (step3 / "global_step3").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert (step3 / "zero_to_fp32.py").is_file()

    resumed = train(tmp_path, stage=2, out=str(tmp_path / "resumed"), resume=str(step3))
    # the log history of steps 1-3 comes back with the trainer state; steps 4-6 are recomputed, and equal
    assert resumed["steps"] == 6 and resumed["losses"] == full["losses"]
    want = load_file(tmp_path / "full" / "checkpoint-6" / "model.safetensors")
    got = load_file(tmp_path / "resumed" / "checkpoint-6" / "model.safetensors")
    initial = load_file(step3 / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert any(not torch.equal(want[k], initial[k]) for k in want)  # the last three steps did train


def test_stage1_with_cpu_offload_and_bf16(tmp_path):
    result = train(tmp_path, stage=1, offload=True, bf16=True, out=str(tmp_path / "out"))
    assert result["stage"] == 1 and result["steps"] == 6 and len(result["losses"]) == 6
    files = sorted(p.name for p in (tmp_path / "out" / "checkpoint-6" / "global_step6").iterdir())
    assert files == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                     "mp_rank_00_model_states.pt"]

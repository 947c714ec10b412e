"""Hugging Face clients on our engine with ZeRO stage 3, on two real CPU ranks (gloo) started by the ``deepspeed``
launcher: the Transformers ``Trainer`` (``"auto"`` values, a consolidated ``save_model``, a checkpoint resume,
``evaluate``), ``from_pretrained`` under ``HfDeepSpeedConfig`` (Transformers builds the model partitioned with
``deepspeed.zero.Init`` and loads it through ``GatheredParameters``) and Accelerate's own API with
``DeepSpeedPlugin(zero_stage=3)``.

The launch helper and the Accelerate preamble are the stage-1/2 tests' (``test_accelerate.py``).

Measured (torch 2.13 CPU, fp32, 2 gloo ranks): the Trainer resumed from step 3 repeats steps 4-6 bit for bit
(losses, weights, eval loss); ``from_pretrained`` under ZeRO-3 gathers exactly the saved weights; Accelerate's
ZeRO-3 weights are within 3e-8 of the one-process reference (bound 1e-6) and its gradient norms within a
relative 1e-7 (bound 1e-5). The file runs in about 45 s (three two-rank launches of ~12-19 s each).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

_NAME = "_deepspeed_test_accelerate_common"
if _NAME not in sys.modules:  # tests/deepspeed is not a package (pytest's importlib mode): load it by path
    _spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).with_name("test_accelerate.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)
common = sys.modules[_NAME]
launch = common.launch

pytestmark = common.pytestmark

TRAINER = textwrap.dedent("""
    import json, os
    import torch
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    setup = json.loads(os.environ["ACC_SETUP"])  # argv has the launcher's --local_rank
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
    }

    class Tokens(torch.utils.data.Dataset):
        # counting sequences (a random start, then +1 modulo the vocabulary): learnable within a few steps
        def __init__(self, n, seed):
            self.starts = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))

        def __len__(self):
            return len(self.starts)

        def __getitem__(self, i):
            ids = (self.starts[i] + torch.arange(32)) % 128
            return {"input_ids": ids, "labels": ids}

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    out = setup["out"]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=6, learning_rate=3e-3, warmup_steps=2,
                             max_grad_norm=0.5, logging_steps=1, save_strategy="steps", save_steps=3,
                             deepspeed=ds_config, report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 1), eval_dataset=Tokens(16, 2))
    trainer.train(resume_from_checkpoint=setup.get("resume"))
    engine = trainer.model_wrapped
    metrics = trainer.evaluate()
    result = {"engine": type(engine).__name__, "stage": engine.zero_optimization_stage(),
              "optimizer": type(engine.optimizer).__name__, "steps": trainer.state.global_step,
              "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
              "eval_loss": metrics["eval_loss"],
              "partitioned": sum(p.numel() == 0 and p.ds_tensor.numel() == (p.ds_numel + 1) // 2
                                 for p in model.parameters()),
              "persistent": sum(p.ds_persist for p in model.parameters())}
    trainer.save_model(os.path.join(out, "final"))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    if trainer.is_world_process_zero():
        torch.save(trained, os.path.join(out, "trained.pt"))

    if setup.get("from_pretrained"):
        # Transformers' own ZeRO-3 path: a live HfDeepSpeedConfig makes from_pretrained build the model under
        # deepspeed.zero.Init and load rank 0's file into the partitions through GatheredParameters
        keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": False},
                                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
        loaded = GPT2LMHeadModel.from_pretrained(os.path.join(out, "final"))
        params = dict(loaded.named_parameters())
        result["zero3_enabled"] = is_deepspeed_zero3_enabled()
        result["loaded_partitioned"] = all(hasattr(p, "ds_id") and p.numel() == 0 for p in params.values())
        result["loaded_local"] = {n: p.ds_tensor.numel() for n, p in params.items()}
        with deepspeed.zero.GatheredParameters(list(params.values())):
            result["loaded_max_diff"] = max((p - trained[n]).abs().max().item() for n, p in params.items())
            result["tied"] = loaded.lm_head.weight is loaded.transformer.wte.weight
    if trainer.is_world_process_zero():
        print("RESULT " + json.dumps(result), flush=True)
""")


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    return tmp, launch(tmp, TRAINER, out=str(tmp / "full"), from_pretrained=True)


def test_trainer_trains_saves_a_consolidated_model_and_evaluates(trainer_run):
    tmp, r = trainer_run
    assert r["engine"] == "DeepSpeedEngine" and r["stage"] == 3 and r["steps"] == 6
    assert r["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    # "auto" persistence threshold = 10 * n_embd: the 2-D weights (and wte, wpe) are partitioned, the rest kept
    assert (r["partitioned"], r["persistent"]) == (10, 18), r
    losses = r["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
    assert 0 < r["eval_loss"] < losses[0]
    saved = load_file(tmp / "full" / "final" / "model.safetensors")
    trained = torch.load(tmp / "full" / "trained.pt")
    # the tied lm_head is not stored twice (Transformers drops it); every stored tensor is the trained one
    assert set(saved) == set(trained) - {"lm_head.weight"}
    assert all(torch.equal(saved[k], trained[k]) for k in saved)


def test_from_pretrained_under_hf_deepspeed_config_builds_partitioned(trainer_run):
    _, r = trainer_run
    assert r["zero3_enabled"] and r["loaded_partitioned"] and r["tied"]
    assert r["loaded_local"]["transformer.h.0.attn.c_attn.weight"] == 64 * 192 // 2  # this rank's half
    assert r["loaded_max_diff"] == 0.0


def test_trainer_resumes_from_a_mid_run_checkpoint(trainer_run):
    tmp, full = trainer_run
    step3 = tmp / "full" / "checkpoint-3"
    assert (step3 / "latest").read_text().strip() == "global_step3"
    assert sorted(p.name for p in (step3 / "global_step3").iterdir()) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    resumed = launch(tmp, TRAINER, out=str(tmp / "resumed"), resume=str(step3))
    assert resumed["steps"] == 6 and resumed["losses"] == full["losses"]
    want = load_file(tmp / "full" / "checkpoint-6" / "model.safetensors")
    got = load_file(tmp / "resumed" / "checkpoint-6" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert resumed["eval_loss"] == full["eval_loss"]


ACCELERATE = common.PREAMBLE + textwrap.dedent("""
    import copy
    plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=2, gradient_clipping=1.0,
                             zero3_save_16bit_model=True)
    # the tiny net's tensors are all below the default persistence threshold (1e5 elements): partition them all,
    # so every forward and backward gathers and releases them
    plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    acc = Accelerator(deepspeed_plugin=plugin)
    model = net()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt, dl = acc.prepare(model, opt, loader())
    partitioned = all(p.numel() == 0 and p.ds_tensor.numel() == (p.ds_numel + 1) // 2
                      for p in model.module.parameters())
    losses, norms = train(acc, model, opt, None, dl, 16)  # the whole epoch: 4 optimizer steps

    ref_norms = train_reference(reference)
    weights = acc.get_state_dict(model)  # collective: rank 0 gets the whole weights, the other rank nothing
    keys = sorted(weights)
    max_diff = max((weights[k] - v).abs().max().item() for k, v in reference.state_dict().items()) if keys else None

    out = setup["out"]
    losses_equal, weights_equal = resume_round_trip(acc, model, opt, None, dl, os.path.join(out, "state"))
    acc.wait_for_everyone()
    acc.save_model(model, os.path.join(out, "model"))
    report(acc, engine=type(model).__name__, zero_stage=model.zero_optimization_stage(), steps=model.global_steps,
           optimizer=type(opt).__name__, partitioned=partitioned, keys=keys, max_diff=max_diff, norms=norms,
           ref_norms=ref_norms, resumed_losses_equal=losses_equal, resumed_weights_equal=weights_equal,
           state_files=sorted(os.listdir(os.path.join(out, "state"))))
""")


def test_accelerate_zero3_matches_one_process_and_gathers_the_state_dict(tmp_path):
    r = launch(tmp_path, ACCELERATE)
    assert r["engine"] == "DeepSpeedEngine" and r["zero_stage"] == 3 and r["steps"] == 4 + 2
    assert r["optimizer"] == "DeepSpeedOptimizerWrapper" and r["partitioned"]
    assert r["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert r["max_diff"] < 1e-6
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
    assert r["resumed_losses_equal"] and r["resumed_weights_equal"]
    assert {"latest", "pytorch_model", "zero_to_fp32.py"} <= set(r["state_files"])
    saved = load_file(tmp_path / "out" / "model" / "model.safetensors")
    assert sorted(saved) == r["keys"]

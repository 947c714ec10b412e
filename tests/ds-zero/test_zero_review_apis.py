"""Adversarial review of the ZeRO stage 1/2 debug APIs (``deepspeed.utils.safe_*``), ``offload_states`` and the
checkpoint round trips around them, through ``deepspeed.initialize`` on 1 and 2 gloo ranks. Passing tests pin
behaviour found correct, and regression tests for the bugs this review found."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

IN, HID, OUT = 6, 10, 6  # HID*IN + HID = 70 elements: the first weight spans both ranks' partitions at 2 ranks
LR = 0.01
ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}}


class Tied(torch.nn.Module):
    """A square layer applied twice (one Parameter used by two call sites) plus a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, HID)
        self.mid = torch.nn.Linear(HID, HID)
        self.out = torch.nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid(h))  # the same weight again: its gradient sums both uses
        return self.out(h)


class SharedHead(torch.nn.Module):
    """Embedding-style weight tying: two modules hold the same Parameter object."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(IN, IN, bias=False)
        self.b = torch.nn.Linear(IN, IN, bias=False)
        self.b.weight = self.a.weight
        self.c = torch.nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make_model(kind: str = "tied", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return {"tied": Tied, "shared": SharedHead}[kind]()


def make_config(stage: int, precision: str = "fp32", gas: int = 1, zero: dict | None = None, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "optimizer": ADAMW,
              "zero_optimization": {"stage": stage, **(zero or {})}, "steps_per_print": 1000, **extra}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def batch(seed: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2 * world, IN, generator=gen), torch.randn(2 * world, OUT, generator=gen)


def engine_backward(engine, seed: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(seed, world)
    dtype = next(engine.module.parameters()).dtype
    out = engine(x[2 * rank:2 * rank + 2].to(dtype)).float()
    engine.backward(torch.nn.functional.mse_loss(out, y[2 * rank:2 * rank + 2]))


def reference_grads(model: torch.nn.Module, seed: int, world: int) -> list[torch.Tensor]:
    """Full-batch gradients of a plain fp32 copy (mean over the global batch = average of the ranks' means)."""
    x, y = batch(seed, world)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


# ---- tied parameters and parameters split across partitions -------------------------------------------------------
def _tied_body(kind: str, stage: int, zero: dict) -> list[float]:
    import deepspeed
    from ds_zero.debug import safe_get_full_fp32_param, safe_get_full_grad, safe_set_full_fp32_param

    engine = deepspeed.initialize(model=make_model(kind), config=make_config(stage, zero=zero))[0]
    ref = make_model(kind)
    params = list(engine.module.parameters())
    assert len(params) == len(list(ref.parameters()))  # a tied weight appears once
    if dist.get_world_size() > 1:  # some parameter is really split between the two ranks' partitions
        fg = engine.optimizer.groups[0]
        assert any(len(fg.layout.owners(i)) > 1 for i in range(len(fg.params)))
    engine_backward(engine, seed=3)
    want = reference_grads(ref, 3, dist.get_world_size())
    errors = [rel(safe_get_full_grad(p), w) for p, w in zip(params, want, strict=True)]
    value = torch.arange(params[1].numel(), dtype=torch.float32).view(params[1].shape) / 100
    safe_set_full_fp32_param(params[1], value)  # the tied one in both models
    assert torch.equal(safe_get_full_fp32_param(params[1]), value) and torch.equal(params[1].detach(), value)
    return errors


@pytest.mark.parametrize(("kind", "stage", "world", "zero"), [
    ("tied", 2, 2, {}),
    ("tied", 1, 2, {}),
    ("shared", 2, 2, {"round_robin_gradients": True}),
    ("shared", 2, 1, {"overlap_comm": True, "reduce_bucket_size": 40}),
])
def test_tied_and_split_parameters(kind, stage, world, zero):
    for errors in run_distributed(_tied_body, world_size=world, args=(kind, stage, zero), timeout=60):
        assert max(errors) <= 1e-5, errors


# ---- gradient dtype: "the data type used for gradient accumulation" ----------------------------------------------
def _grad_dtype_body(stage: int, gas: int) -> list[str]:
    import deepspeed
    from ds_zero.debug import safe_get_full_grad

    engine = deepspeed.initialize(model=make_model(), config=make_config(stage, "bf16", gas=gas))[0]
    out = []
    for seed in range(gas):
        engine_backward(engine, seed)
        out.append(str(safe_get_full_grad(next(engine.module.parameters())).dtype))
        engine.step()
    return out


@pytest.mark.parametrize(("stage", "world", "gas"), [(1, 1, 1), (1, 1, 2), (2, 2, 1), (2, 2, 2)])
def test_bf16_grad_dtype_is_the_accumulation_dtype(stage, world, gas):
    for dtypes in run_distributed(_grad_dtype_body, world_size=world, args=(stage, gas), timeout=60):
        assert dtypes == ["torch.bfloat16"] * gas


@pytest.mark.parametrize("gas", [1, 2])
def test_bf16_stage1_reduced_grad_dtype(gas):
    for dtypes in run_distributed(_grad_dtype_body, world_size=2, args=(1, gas), timeout=60):
        assert dtypes == ["torch.bfloat16"] * gas


# ---- optimizer state before the first step -----------------------------------------------------------------------
def _state_before_step_body(action: str) -> str:
    import deepspeed
    from ds_zero.debug import safe_get_full_optimizer_state, safe_set_full_optimizer_state

    engine = deepspeed.initialize(model=make_model(), config=make_config(2))[0]
    p = next(engine.module.parameters())
    if action == "get":
        try:
            got = safe_get_full_optimizer_state(p, "exp_avg")
        except ValueError as exc:
            return f"ValueError: {exc}"
        return f"value {got}"
    safe_set_full_optimizer_state(p, torch.full(p.shape, 0.5), "exp_avg")  # the spec's example, right after init
    assert torch.equal(safe_get_full_optimizer_state(p, "exp_avg"), torch.full(p.shape, 0.5))
    return "ok"


def test_get_optimizer_state_before_first_step_is_a_clear_error():
    (msg,) = run_distributed(_state_before_step_body, world_size=1, args=("get",), timeout=60)
    assert msg.startswith("ValueError") and "not stepped" in msg, msg


def test_set_optimizer_state_right_after_initialize():
    assert run_distributed(_state_before_step_body, world_size=2, args=("set",), timeout=60) == ["ok", "ok"]


# ---- checkpoints around the setters and offload_states --------------------------------------------------------------
def _full_states(engine) -> dict[str, torch.Tensor]:
    from ds_zero.debug import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        out[f"{name}.fp32"] = safe_get_full_fp32_param(p)
        out[f"{name}.exp_avg"] = safe_get_full_optimizer_state(p, "exp_avg")
        out[f"{name}.exp_avg_sq"] = safe_get_full_optimizer_state(p, "exp_avg_sq")
    return out


def _checkpoint_body(save_dir: str, stage: int, precision: str, offload: str | None) -> dict:
    import deepspeed
    from ds_zero.debug import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from ds_zero.offload_states import _offload, _Transfer, get_state_devices, reload_states

    config = make_config(stage, precision)
    engine = deepspeed.initialize(model=make_model(), config=config)[0]
    engine_backward(engine, 0)
    engine.step()
    names = [n for n, _ in engine.module.named_parameters()]
    p = engine.module.get_parameter(names[0])
    value = torch.linspace(-2.0, 2.0, p.numel()).view(p.shape)
    safe_set_full_fp32_param(p, value)
    safe_set_full_optimizer_state(p, torch.full(p.shape, 0.125), "exp_avg_sq")
    before = _full_states(engine)
    if offload is not None:  # offload every state (forced copies on CPU), then save WITHOUT reloading
        from ds_zero.offload_states import OffloadStateTypeEnum

        _offload(engine.optimizer, list(OffloadStateTypeEnum), torch.device("cpu"), _Transfer(copy=True))
        assert all(get_state_devices(engine, s) <= {torch.device("cpu")} for s in OffloadStateTypeEnum)
    engine.save_checkpoint(save_dir, tag="t")
    if offload == "step":  # train on without reload_states (CPU: every state is already where it belongs)
        engine_backward(engine, 1)
        engine.step()
        reload_states(engine)
    fresh = deepspeed.initialize(model=make_model(kind="tied", seed=7), config=config)[0]
    fresh.load_checkpoint(save_dir, tag="t")
    after = _full_states(fresh)
    for key, want in before.items():
        assert torch.equal(after[key], want), key
    assert torch.equal(after[f"{names[0]}.fp32"], value)
    weight = fresh.module.get_parameter(names[0]).detach()
    assert torch.equal(weight, value.to(weight.dtype))
    if offload == "step":  # the engine that trained on after offload matches a fresh resume doing the same
        engine_backward(fresh, 1)
        fresh.step()
        for (n, a), b in zip(fresh.module.named_parameters(), engine.module.parameters(), strict=True):
            assert torch.equal(a.detach(), b.detach()), n
    dist.barrier()
    return {"value": value}


@pytest.mark.parametrize(("stage", "world", "precision", "offload"), [
    (2, 2, "fp32", None),
    (1, 2, "bf16", None),
    (2, 2, "fp32", "save"),
    (2, 2, "bf16", "step"),
    (1, 1, "fp32", "step"),
])
def test_setters_and_offload_survive_checkpoint(tmp_path, stage, world, precision, offload):
    from ds_zero.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    results = run_distributed(_checkpoint_body, world_size=world, args=(str(tmp_path), stage, precision, offload),
                              timeout=60)
    state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    assert torch.equal(state["inp.weight"], results[0]["value"])  # the set fp32 value reached the fp32 export


# ---- round_robin_gradients: the flat order is not the model's --------------------------------------------------------
def _round_robin_save_body(save_dir: str) -> dict:
    import deepspeed
    from ds_zero.debug import safe_get_full_fp32_param

    config = make_config(2, zero={"round_robin_gradients": True})
    engine = deepspeed.initialize(model=make_model("shared"), config=config)[0]
    fg = engine.optimizer.groups[0]
    assert fg.names != [n for n, _ in engine.module.named_parameters()]  # really reordered
    for seed in range(2):
        engine_backward(engine, seed)
        engine.step()
    engine.save_checkpoint(save_dir, tag="rr")
    return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}


def _round_robin_load_body(save_dir: str) -> dict:
    import deepspeed
    from ds_zero.debug import safe_get_full_fp32_param

    engine = deepspeed.initialize(model=make_model("shared", seed=5),
                                  config=make_config(2, zero={"round_robin_gradients": True}))[0]
    engine.load_checkpoint(save_dir, tag="rr")
    return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}


def test_round_robin_checkpoint_export_and_resume_on_other_world(tmp_path):
    from ds_zero.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    saved = run_distributed(_round_robin_save_body, world_size=2, args=(str(tmp_path),), timeout=60)[0]
    exported = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="rr")
    assert torch.equal(exported["b.weight"], exported["a.weight"])  # the tied alias is exported too
    for name, want in saved.items():
        assert torch.equal(exported[name], want), name
    (resumed,) = run_distributed(_round_robin_load_body, world_size=1, args=(str(tmp_path),), timeout=60)
    for name, want in saved.items():
        assert torch.equal(resumed[name], want), name


# ---- fp16: an inf set through safe_set_full_grad (one owner) is an overflow on every rank ------------------------
def _fp16_inf_body() -> dict:
    import deepspeed
    from ds_zero.debug import safe_get_full_grad, safe_set_full_grad

    config = make_config(2, "fp16")
    config["fp16"].update(hysteresis=1, min_loss_scale=1)  # the first overflow halves the scale
    engine = deepspeed.initialize(model=make_model(), config=config)[0]
    params = list(engine.module.parameters())
    before = [p.detach().clone() for p in params]
    scale = engine.optimizer.loss_scale
    engine_backward(engine, 0)
    bad = safe_get_full_grad(params[-1]).clone()  # the same value on every rank, as the API requires
    bad.view(-1)[-1] = float("inf")  # an element only one rank's partition holds: the overflow must be global
    safe_set_full_grad(params[-1], bad)
    engine.step()
    unchanged = all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    return {"applied": engine.was_step_applied(), "unchanged": unchanged,
            "scale": engine.optimizer.loss_scale / scale, "grad_after": safe_get_full_grad(params[0]) is None}


def test_fp16_inf_grad_set_by_one_rank_skips_the_step_everywhere():
    for r in run_distributed(_fp16_inf_body, world_size=2, timeout=60):
        assert r == {"applied": False, "unchanged": True, "scale": 0.5, "grad_after": True}


def test_copied_script_converts_tied_round_robin_checkpoint_to_safetensors(tmp_path):
    import os
    import subprocess
    import sys

    safetensors = pytest.importorskip("safetensors.torch")
    saved = run_distributed(_round_robin_save_body, world_size=2, args=(str(tmp_path / "ck"),), timeout=60)[0]
    script = tmp_path / "ck" / "zero_to_fp32.py"  # beside "latest", where DeepSpeed puts it
    assert script.is_file()
    # DeepSpeed's usage: run the copy from inside the checkpoint folder, no PYTHONPATH tricks
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script), ".", "out", "--safe_serialization", "--max_shard_size", "150"],
                          cwd=tmp_path / "ck", env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "ck" / "out"
    state = {}
    for shard in sorted(out.glob("*.safetensors")):
        state.update(safetensors.load_file(str(shard)))
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    assert state.keys() == saved.keys() | {"b.weight"}  # the tied alias too, a copy (safetensors shares nothing)
    assert torch.equal(state["b.weight"], state["a.weight"])
    for name, want in saved.items():
        assert torch.equal(state[name], want), name


# ---- safe_set_full_grad must not keep the caller's tensor as the gradient ------------------------------------------
def _grad_alias_body(precision: str, extra: dict) -> dict:
    import deepspeed
    from ds_zero.debug import safe_get_full_grad, safe_set_full_grad

    config = make_config(1, precision, gas=2, **extra)
    engine = deepspeed.initialize(model=make_model(), config=config)[0]
    inp_b, mid_b = engine.module.inp.bias, engine.module.mid.bias  # same size (HID)
    accum = torch.float32 if precision == "fp32" or extra else inp_b.dtype
    engine_backward(engine, 0)  # micro step 1 of 2: not reduced yet (local gradients)
    engine.step()
    zeros = torch.zeros(HID, dtype=accum)  # one value for both: the spec's "zero the gradients" example
    safe_set_full_grad(inp_b, zeros)
    safe_set_full_grad(mid_b, zeros)
    engine_backward(engine, 1)  # micro step 2: each gradient is now 0 + its own micro-step-2 gradient
    got = {"inp": safe_get_full_grad(inp_b).float(), "mid": safe_get_full_grad(mid_b).float()}
    fresh = deepspeed.initialize(model=make_model(), config=config)[0]  # the same micro step 2 alone
    engine_backward(fresh, 1)
    want = {"inp": safe_get_full_grad(fresh.module.inp.bias).float(),
            "mid": safe_get_full_grad(fresh.module.mid.bias).float()}
    return {"caller_tensor_untouched": bool(torch.equal(zeros, torch.zeros_like(zeros))),
            "errors": {k: rel(got[k], want[k]) for k in got}}


@pytest.mark.parametrize(("precision", "extra"), [("fp32", {}),
                                                  ("bf16", {"data_types": {"grad_accum_dtype": "fp32"}})])
def test_set_full_grad_copies_the_value(precision, extra):
    (r,) = run_distributed(_grad_alias_body, world_size=1, args=(precision, extra), timeout=60)
    assert r["caller_tensor_untouched"], r
    assert max(r["errors"].values()) <= 1e-6, r


# ---- setters under CPU optimizer offload (DeepSpeedCPUAdam steps the CPU masters) -----------------------------------
def _cpu_adam_setters_body(precision: str) -> float:
    import deepspeed
    from ds_zero.debug import safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state

    config = make_config(2, precision, zero={"offload_optimizer": {"device": "cpu"}},
                         optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}})
    engine = deepspeed.initialize(model=make_model(), config=config)[0]
    assert type(engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    params, ref_params = list(engine.module.parameters()), list(ref.parameters())
    world = dist.get_world_size()
    for seed in range(3):
        engine_backward(engine, seed)
        for r, g in zip(ref_params, reference_grads(ref, seed, world), strict=True):
            r.grad = g
        if seed == 2:  # replace one gradient too
            safe_set_full_grad(params[2], torch.full(params[2].shape, 0.01, dtype=params[2].dtype))
            ref_params[2].grad = torch.full(params[2].shape, 0.01)
        engine.step()
        ref_opt.step()
        if seed == 0:
            value = torch.linspace(-0.5, 0.5, params[0].numel()).view(params[0].shape)
            safe_set_full_fp32_param(params[0], value)
            safe_set_full_optimizer_state(params[0], torch.zeros(params[0].shape), "exp_avg")
            safe_set_full_optimizer_state(params[0], torch.full(params[0].shape, 0.25), "exp_avg_sq")
            with torch.no_grad():
                ref_params[0].copy_(value)
            ref_opt.state[ref_params[0]]["exp_avg"].zero_()
            ref_opt.state[ref_params[0]]["exp_avg_sq"].fill_(0.25)
    return max(rel(p, r) for p, r in zip(params, ref_params, strict=True))


@pytest.mark.parametrize(("world", "precision", "tol"), [(2, "fp32", 1e-5), (1, "bf16", 2e-2)])
def test_setters_with_cpu_adam_offload_follow_the_reference(world, precision, tol):
    for err in run_distributed(_cpu_adam_setters_body, world_size=world, args=(precision,), timeout=60):
        assert err <= tol, err


# ---- stage 0 with bf16: fp32 masters exist (DeepSpeed's BF16_Optimizer links them for the safe_* APIs) ---------------
def _stage0_bf16_body() -> dict:
    import deepspeed
    from ds_zero.debug import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = deepspeed.initialize(model=make_model(), config=make_config(0, "bf16"))[0]
    engine_backward(engine, 0)
    engine.step()
    p = next(engine.module.parameters())
    master = engine.optimizer.master_of[p]
    full = safe_get_full_fp32_param(p)
    exp_avg = safe_get_full_optimizer_state(p, "exp_avg")
    want = engine.optimizer.optimizer.state[master]["exp_avg"]
    return {"fp32": full is not None and torch.equal(full, master.detach()),
            "exp_avg": exp_avg is not None and torch.equal(exp_avg, want)}


def test_stage0_bf16_masters_are_reachable():
    (r,) = run_distributed(_stage0_bf16_body, world_size=1, timeout=60)
    assert r == {"fp32": True, "exp_avg": True}


# ---- command lines with odd inputs ---------------------------------------------------------------------------------
def _stage0_save_body(save_dir: str) -> None:
    import deepspeed

    engine = deepspeed.initialize(model=make_model(), config=make_config(0))[0]
    engine_backward(engine, 0)
    engine.step()
    engine.save_checkpoint(save_dir)


def test_zero_to_fp32_cli_on_a_stage0_checkpoint_and_missing_dirs(tmp_path, capsys):
    from ds_zero.zero_to_fp32 import main

    run_distributed(_stage0_save_body, world_size=1, args=(str(tmp_path / "ck"),), timeout=60)
    capsys.readouterr()
    assert main([str(tmp_path / "ck"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "zero_pp_rank_" in err and "not a ZeRO" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "pytorch_model.bin").exists()
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 1
    assert "'" + str(tmp_path / "nowhere") + "' does not exist" in capsys.readouterr().err
    assert main([str(tmp_path / "ck"), str(tmp_path / "out"), "-t", "global_step99"]) == 1
    assert "global_step99" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "code", "needle"), [
    (["--params", "0"], 0, "0.00GB"),  # an empty model is a valid (if useless) question
    (["--params", "2851e6", "--nodes", "0"], 2, "--nodes must be an int >= 1, got 0"),
    (["--params", "2851e6", "--gpus-per-node", "-1"], 2, "--gpus-per-node must be an int >= 1, got -1"),
    (["--params", "-5"], 2, "not a parameter count: '-5'"),
    (["--params", "1e30"], 2, "between 0 and 1e18"),
    (["--params", "10", "--largest-layer", "11", "--stage", "3"], 2, "cannot exceed total_params"),
    (["--params", "10", "--buffer-factor", "nan"], 2, "finite number > 0"),
])
def test_ds_estimate_odd_inputs(argv, code, needle, capsys):
    from ds_zero.estimate.cli import main

    assert main(argv) == code
    out = capsys.readouterr()
    assert needle in (out.out if code == 0 else out.err)

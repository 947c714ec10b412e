"""Adversarial edge cases of ZeRO stages 1 and 2 through ``deepspeed.initialize`` on gloo ranks, each compared
with stage 0 (same engine, unpartitioned) or a single-process torch run: rank-dependent unused parameters,
parameters outside the optimizer, frozen-only groups, parameters larger than a bucket, sparse gradients,
torch_autocast, accumulation-boundary overrides, retain_graph, activation checkpointing, checkpoints (before
any step, toggled layout options, rank-dependent tags, another model's tag), loss-scale limits, LR schedules and
odd world sizes. Each bug this review found has its regression test here.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _harness import DistributedTestFailure, run_distributed

IN, HID, OUT = 5, 8, 3
BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6}
ADAMW = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}}


# ---- models --------------------------------------------------------------------------------------------------
class Branchy(torch.nn.Module):
    """An MLP with a side branch that only some ranks/steps use (``use_side``), a wide layer (``big``, larger
    than small reduce buckets) and an optional checkpointed middle block."""

    def __init__(self, ckpt: str | None = None, sparse: bool = False, empty: bool = False) -> None:
        super().__init__()
        # a zero-element parameter (with a gradient) between the others: a fragment-less tensor in the layout
        self.empty = torch.nn.Parameter(torch.zeros(0)) if empty else None
        self.embed = torch.nn.Embedding(7, IN, sparse=sparse)
        self.first = torch.nn.Linear(IN, HID)
        self.big = torch.nn.Linear(HID, HID)
        self.side = torch.nn.Linear(IN, OUT)
        self.head = torch.nn.Linear(HID, OUT)
        self.ckpt = ckpt

    def _middle(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.big(h))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.first(x + self.embed(ids)))
        if self.empty is not None:
            h = h + self.empty.sum()
        def tail(t: torch.Tensor) -> torch.Tensor:
            out = self.head(self._middle(t))
            return out + self.side(x) if use_side else out

        if self.ckpt == "reentrant_all":  # no parameter after the checkpointed block: the first gradients to land
            return checkpoint(tail, h, use_reentrant=True)  # come from a nested backward
        if self.ckpt is None:
            return tail(h)
        out = self.head(checkpoint(self._middle, h, use_reentrant=self.ckpt == "reentrant"))
        return out + self.side(x) if use_side else out


def make_model(seed: int = 0, **kwargs) -> Branchy:
    torch.manual_seed(seed)
    return Branchy(**kwargs)


def batches(steps: int, batch: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, IN, generator=gen), torch.randint(7, (batch,), generator=gen),
             torch.randn(batch, OUT, generator=gen)) for _ in range(steps)]


def zcfg(zero: dict, **extra) -> dict:
    return {**BASE, "optimizer": ADAMW, "zero_optimization": zero, **extra}


# ---- the rank body -------------------------------------------------------------------------------------------
def _optimizer_kwargs(model: Branchy, how: str | None) -> dict:
    if how == "subset":  # a trainable parameter that the optimizer never sees
        return {"model_parameters": [p for n, p in model.named_parameters() if not n.startswith("side.")]}
    if how == "frozen_group":  # one group that ends up empty (only frozen parameters), one with a frozen bias
        model.embed.requires_grad_(False)
        model.first.bias.requires_grad_(False)
        rest = [p for n, p in model.named_parameters() if not n.startswith("embed.")]
        return {"model_parameters": [{"params": list(model.embed.parameters()), "lr": 0.5},
                                     {"params": rest, "lr": 0.02}]}
    if how in ("pair", "pair_swapped"):  # two groups of equal size (8 elements), listed in either order
        pair = [[model.first.bias], [model.big.bias]]
        pair = pair[::-1] if how == "pair_swapped" else pair
        rest = [p for n, p in model.named_parameters() if n not in ("first.bias", "big.bias")]
        return {"model_parameters": [{"params": pair[0]}, {"params": pair[1]}, {"params": rest}]}
    if how == "groups":
        return {"model_parameters": [{"params": list(model.head.parameters()), "lr": 0.01},
                                     {"params": [p for n, p in model.named_parameters() if not n.startswith("head.")],
                                      "lr": 0.03}]}
    return {}


def _micro_step(engine, run: dict, step: int, g: int, data, use_side: bool) -> float:
    x, ids, y = data
    dtype = next(p.dtype for p in engine.module.parameters() if p.is_floating_point())
    x = x.to(dtype) if run.get("cast", True) else x.clone()
    if step in run.get("inject", ()) and g == 0 and dist.get_rank() == 0:
        x[0, 0] = math.inf
    loss = torch.nn.functional.mse_loss(engine(x, ids, use_side=use_side).float(), y)
    if run.get("boundary_override"):
        engine.set_gradient_accumulation_boundary(g == run["gas"] - 1)
    if run.get("direct"):  # loss.backward() through the engine's hooks, as Accelerate's fp32 path does
        (loss / run.get("gas", 1)).backward()
        return float(loss.detach())
    if run.get("double_backward"):  # the same loss twice through retain_graph: twice the gradient
        engine.backward(loss, retain_graph=True)
    engine.backward(loss)
    return float(loss.detach())


def train(config: dict, run: dict, engine=None) -> dict:
    """Train ``run["steps"]`` steps (GAS ``run["gas"]``) on this rank's slices of fixed global batches; returns
    weights (fp32), losses, grad norms, loss scales, lrs and skipped-step counts."""
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    gas, micro = run.get("gas", 1), BASE["train_micro_batch_size_per_gpu"]
    if engine is None:
        model = make_model(seed=rank, ckpt=run.get("ckpt"), sparse=run.get("sparse", False),
                           empty=run.get("empty", False))
        engine, *_ = deepspeed.initialize(model=model, config={**config, "gradient_accumulation_steps": gas},
                                          **_optimizer_kwargs(model, run.get("params")))
    out: dict = {"losses": [], "norms": [], "scales": [], "lrs": [], "skipped": []}
    data = batches(run.get("start", 0) + run.get("steps", 4), micro * gas * world)[run.get("start", 0):]
    for step, (x, ids, y) in enumerate(data, start=run.get("start", 0)):
        for g in range(gas):
            lo = (g * world + rank) * micro
            use = {"all": True, "never": False, "rank0": rank == 0, "alternate": (step + g + rank) % 2 == 0}
            side = use[run.get("side", "all")]
            out["losses"].append(_micro_step(engine, run, step, g, (x[lo:lo + micro], ids[lo:lo + micro],
                                                                    y[lo:lo + micro]), side))
            engine.step()
        out["norms"].append(engine.get_global_grad_norm())
        out["scales"].append(engine.get_loss_scale())
        out["lrs"].append(engine.get_lr())
        out["skipped"].append(engine.skipped_steps)
    out["state"] = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return out


def error_of(fn, *args) -> str:
    """Run ``fn(*args)`` on a rank and return its error (``"no error"``): a rank that raises would cost the pool its
    worker process (seconds to replace), and the test compares the ranks' outcomes anyway."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def run_world(config: dict, run: dict, world: int = 2) -> list[dict]:
    return run_distributed(train, world_size=world, args=(config, run), timeout=60)


def rel_error(got: dict, want: dict) -> float:
    worst = 0.0
    for key, value in want.items():
        diff = float((got[key].float() - value.float()).norm())
        worst = max(worst, diff / max(float(value.float().norm()), 1e-12))
    return worst


def assert_like_stage0(zero: dict, run: dict, world: int = 2, bound: float = 1e-6, base_run: dict | None = None,
                       **extra) -> list[dict]:
    got = run_world(zcfg(zero, **extra), run, world)
    base = run_world(zcfg({"stage": 0}, **extra), base_run or run, world)
    for r in got[1:]:
        assert rel_error(r["state"], got[0]["state"]) == 0.0, "ranks ended with different weights"
    assert rel_error(got[0]["state"], base[0]["state"]) <= bound
    if base[0]["norms"][0] is not None:  # stage 0 computes the norm only for clipping or overflow checks
        assert [n is None for n in got[0]["norms"]] == [n is None for n in base[0]["norms"]]
        assert [n for n in got[0]["norms"] if n is not None] == pytest.approx(
            [n for n in base[0]["norms"] if n is not None], rel=max(bound, 1e-6))
    return got


S2_SMALL = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 30}  # several buckets, `big` alone in-place


# ---- gradients that do not arrive everywhere -------------------------------------------------------------------
@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 30},
                                  {"stage": 2}, S2_SMALL], ids=["s1", "s1_overlap_small", "s2", "s2_overlap_small"])
@pytest.mark.parametrize("side", ["rank0", "alternate"])
def test_rank_dependent_unused_parameters_match_stage0(zero, side):
    assert_like_stage0(zero, {"side": side, "gas": 2, "steps": 3}, gradient_clipping=0.5)


@pytest.mark.parametrize("zero", [{"stage": 1}, S2_SMALL], ids=["s1", "s2_overlap_small"])
def test_zero_element_parameter_matches_stage0(zero):
    got = assert_like_stage0(zero, {"empty": True, "gas": 2, "steps": 2}, world=3)
    assert got[0]["state"]["empty"].shape == (0,)


@pytest.mark.parametrize("how", ["subset", "frozen_group", "groups"])
@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_parameter_sets_match_stage0(stage, how):
    got = assert_like_stage0({"stage": stage, "reduce_bucket_size": 30}, {"params": how, "gas": 2, "steps": 3})
    init = make_model(seed=0).state_dict()
    if how == "subset":  # never given to the optimizer: never updated
        assert torch.equal(got[0]["state"]["side.weight"], init["side.weight"])
    if how == "frozen_group":
        assert torch.equal(got[0]["state"]["embed.weight"], init["embed.weight"])
        assert torch.equal(got[0]["state"]["first.bias"], init["first.bias"])


# ---- backward variants: retain_graph, boundary overrides, activation checkpointing ----------------------------
@pytest.mark.parametrize("zero", [{"stage": 2}, S2_SMALL], ids=["s2", "s2_overlap_small"])
def test_retain_graph_double_backward_matches_stage0(zero):
    assert_like_stage0(zero, {"double_backward": True, "gas": 2, "steps": 3}, gradient_clipping=0.5)


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 1, "reduce_bucket_size": 1000}],
                         ids=["default", "big_bucket"])
def test_stage1_retain_graph_double_backward_matches_stage0(zero):
    assert_like_stage0(zero, {"double_backward": True, "gas": 2, "steps": 3}, gradient_clipping=0.5)


@pytest.mark.parametrize("overlap", [False, True])
def test_stage1_param_larger_than_bucket_two_backward_at_boundary(overlap):
    zero = {"stage": 1, "reduce_bucket_size": 30, "overlap_comm": overlap}
    assert_like_stage0(zero, {"double_backward": True, "gas": 2, "steps": 3}, gradient_clipping=0.5)


@pytest.mark.parametrize("zero", [{"stage": 1}, S2_SMALL], ids=["s1", "s2_overlap_small"])
def test_boundary_override_matches_stage0(zero):
    assert_like_stage0(zero, {"boundary_override": True, "gas": 3, "steps": 3})


@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("zero", [{"stage": 2}, S2_SMALL], ids=["s2", "s2_overlap_small"])
def test_activation_checkpointing_matches_stage0(zero, ckpt):
    assert_like_stage0(zero, {"ckpt": ckpt, "gas": 2, "steps": 3}, gradient_clipping=0.5)


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 2}, S2_SMALL,
                                  {"stage": 1, "reduce_bucket_size": 30},
                                  {"stage": 2, "ignore_unused_parameters": False}],
                         ids=["s1", "s2", "s2_overlap_small", "s1_in_place", "s2_strict_unused"])
def test_direct_loss_backward_with_reentrant_checkpoint_around_the_last_layers(zero):
    assert_like_stage0(zero, {"ckpt": "reentrant_all", "direct": True, "gas": 2, "steps": 3}, gradient_clipping=0.5)


# ---- sparse gradients ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("stage", "world"), [(1, 2), (2, 2), (2, 1), (1, 1)])
def test_sparse_embedding_gradients_match_stage0(stage, world):
    # torch AdamW refuses sparse gradients, so stage 0 runs the same model with a dense embedding
    run = {"sparse": True, "gas": 2, "steps": 3}
    assert_like_stage0({"stage": stage}, run, world=world, base_run={**run, "sparse": False})


# ---- precision: torch_autocast, loss-scale limits, bf16 overflow checks -----------------------------------------
def _bucket_dtypes(config: dict) -> dict[str, str]:
    import deepspeed

    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    names = {p: n for n, p in engine.module.named_parameters()}
    return {names[p]: str(b.dtype) for b in engine.optimizer.reducer.buckets for p in b.params}


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_autocast_reduces_safe_module_gradients_in_autocast_dtype(stage):
    config = zcfg({"stage": stage}, torch_autocast={"enabled": True, "dtype": "bfloat16"})
    dtypes = run_distributed(_bucket_dtypes, world_size=2, args=(config,), timeout=60)[0]
    assert dtypes["head.weight"] == "torch.bfloat16" and dtypes["big.weight"] == "torch.bfloat16"
    assert dtypes["embed.weight"] == "torch.float32"  # not a lower-precision-safe module


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_autocast_bf16_trains_like_stage0(stage):
    extra = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "gradient_clipping": 0.5}
    got = assert_like_stage0({"stage": stage}, {"gas": 2, "steps": 3, "cast": False}, bound=2e-2, **extra)
    assert got[0]["state"]["head.weight"].dtype == torch.float32


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_autocast_fp16_overflow_is_skipped_like_stage0(stage):
    extra = {"torch_autocast": {"enabled": True, "dtype": "float16"}}
    run = {"gas": 2, "steps": 3, "cast": False, "inject": (1,)}
    got = run_world(zcfg({"stage": stage}, **extra), run)
    base = run_world(zcfg({"stage": 0}, **extra), run)
    assert base[0]["skipped"] == [0, 1, 1] and base[0]["scales"] == [65536.0, 32768.0, 32768.0]
    for r in got:
        assert r["skipped"] == base[0]["skipped"] and r["scales"] == base[0]["scales"]
        assert all(torch.isfinite(v).all() for v in r["state"].values())
    assert rel_error(got[0]["state"], base[0]["state"]) <= 1e-2


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_at_min_loss_scale_raises_on_every_rank_like_stage0(stage):
    fp16 = {"enabled": True, "initial_scale_power": 1, "min_loss_scale": 1, "hysteresis": 1}
    run = {"gas": 1, "steps": 3, "inject": (1, 2)}
    for zero in ({"stage": stage}, {"stage": 0}):
        errors = run_distributed(error_of, world_size=2, args=(train, zcfg(zero, fp16=fp16), run), timeout=60)
        assert all(e.startswith("RuntimeError") and "min_loss_scale" in e for e in errors), errors


@pytest.mark.parametrize("zero", [{"stage": 1}, S2_SMALL], ids=["s1", "s2_overlap_small"])
def test_bf16_check_grad_overflow_skips_like_stage0(zero):
    extra = {"bf16": {"enabled": True, "check_grad_overflow": True}}
    got = assert_like_stage0(zero, {"gas": 2, "steps": 3, "inject": (1,)}, bound=1e-2, **extra)
    assert [r["skipped"] for r in got] == [[0, 1, 1]] * 2


# ---- LR schedules and world sizes --------------------------------------------------------------------------------
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 4}}


@pytest.mark.parametrize("stage", [1, 2])
def test_config_lr_schedule_drives_every_group(stage):
    got = assert_like_stage0({"stage": stage}, {"params": "groups", "steps": 3}, scheduler=WARMUP)
    lrs = got[0]["lrs"]
    assert lrs[0] == [pytest.approx(lrs[0][0])] * 2 and lrs[0][0] < lrs[1][0] < lrs[2][0] <= 0.05


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("zero", [{"stage": 1}, S2_SMALL, {"stage": 2, "round_robin_gradients": True}],
                         ids=["s1", "s2_overlap_small", "s2_round_robin"])
def test_odd_world_sizes_match_stage0(zero, world):
    assert_like_stage0(zero, {"gas": 2, "steps": 3, "side": "alternate"}, world=world, gradient_clipping=0.5)


@pytest.mark.parametrize("zero", [
    {"stage": 1, "allgather_partitions": False, "allgather_bucket_size": 6, "reduce_scatter": False},
    {"stage": 2, "allgather_bucket_size": 6, "reduce_bucket_size": 30, "use_multi_rank_bucket_allreduce": False}],
    ids=["s1_broadcast_allreduce", "s2_chunked_gather_per_owner_reduce"])
def test_three_ranks_with_small_chunks_match_stage0(zero):
    assert_like_stage0(zero, {"gas": 2, "steps": 3, "side": "rank0"}, world=3, gradient_clipping=0.5)


# ---- checkpoints -------------------------------------------------------------------------------------------------
def save_and_resume(save_cfg: dict, load_cfg: dict, run: dict, path: str, at: int) -> dict:
    """Train ``at`` steps (0: none) and save; a fresh engine (other initial weights) with ``load_cfg`` loads and
    trains on to ``run["steps"]``. Returns the weights and lrs at the save and right after the load, and the
    final weights."""
    import deepspeed

    def engine_of(cfg: dict, seed: int, how: str | None):
        model = make_model(seed=seed)
        return deepspeed.initialize(model=model, config=cfg, **_optimizer_kwargs(model, how))[0]

    rank = dist.get_rank()
    engine = engine_of(save_cfg, rank, run.get("params"))
    out = {"saved": train(save_cfg, {**run, "steps": at}, engine=engine)["state"], "lr_saved": engine.get_lr()}
    engine.save_checkpoint(path, tag="ckpt")
    engine = engine_of(load_cfg, rank + 100, run.get("load_params", run.get("params")))
    engine.load_checkpoint(path, tag="ckpt")
    out["loaded"] = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    out["lr_loaded"] = engine.get_lr()
    out["final"] = train(load_cfg, {**run, "start": at, "steps": run["steps"] - at}, engine=engine)["state"]
    return out


def resume(save_cfg: dict, load_cfg: dict, run: dict, path: str, at: int) -> list[dict]:
    return run_distributed(save_and_resume, world_size=2, args=(save_cfg, load_cfg, run, str(path), at), timeout=60)


@pytest.mark.parametrize("at", [0, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_resume_before_and_after_steps_with_schedule_is_exact(tmp_path, stage, at):
    cfg = zcfg({"stage": stage, "reduce_bucket_size": 30}, scheduler=WARMUP, gradient_clipping=0.5)
    run = {"steps": 4, "params": "groups"}
    got = resume(cfg, cfg, run, tmp_path, at)
    straight = run_world(cfg, run)
    for r, s in zip(got, straight, strict=True):
        assert rel_error(r["loaded"], r["saved"]) == 0.0
        assert r["lr_loaded"] == r["lr_saved"]
        assert rel_error(r["final"], s["state"]) == 0.0


def test_resume_with_round_robin_toggled_keeps_the_weights(tmp_path):
    save = zcfg({"stage": 2})
    load = zcfg({"stage": 2, "round_robin_gradients": True})
    for r in resume(save, load, {"steps": 3}, tmp_path, 2):
        assert rel_error(r["loaded"], r["saved"]) == 0.0


def test_resume_with_groups_in_another_order_keeps_the_weights_or_names_them(tmp_path):
    cfg = zcfg({"stage": 1})
    try:
        results = resume(cfg, cfg, {"steps": 3, "params": "pair", "load_params": "pair_swapped"}, tmp_path, 2)
    except DistributedTestFailure as exc:  # refusing is fine, if the error names the mismatched parameters
        assert "first.bias" in str(exc) and "big.bias" in str(exc)
        return
    for r in results:
        assert rel_error(r["loaded"], r["saved"]) == 0.0


def test_loading_another_models_checkpoint_fails_clearly_on_every_rank(tmp_path):
    cfg = zcfg({"stage": 2})
    run = {"steps": 2, "params": "groups", "load_params": None}
    errors = run_distributed(error_of, world_size=2, args=(save_and_resume, cfg, cfg, run, str(tmp_path), 1),
                             timeout=60)
    # the files do not fit on either rank: every rank raises the same agreed error, naming the file
    # CheckpointRankValueError: the CheckpointRankError of a rank whose own failure was a ValueError (bad content)
    assert all(e.startswith("CheckpointRankValueError") and "failed on ranks [0, 1] while reading" in e
               and "_mp_rank_00_optim_states.pt: ZeRO optimizer state has 2 parameter groups" in e
               for e in errors), errors


def _save_with_rank_tags(path: str) -> str:
    import deepspeed

    cfg = zcfg({"stage": 2})
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    train(cfg, {"steps": 1}, engine=engine)
    engine.save_checkpoint(path, tag=f"rank{dist.get_rank()}")  # warned about (tag_validation: Warn)
    return error_of(engine.load_checkpoint, path, f"rank{dist.get_rank()}")


def test_rank_dependent_tags_fail_on_every_rank(tmp_path):
    outcomes = run_distributed(_save_with_rank_tags, world_size=2, args=(str(tmp_path),), timeout=60)
    assert "no error" not in outcomes, outcomes


def _empty_group_checkpoint(path: str) -> tuple[float, list[str]]:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg = zcfg({"stage": 2})
    model = make_model(empty=True)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, **_optimizer_kwargs(model, "frozen_group"))
    state = train(cfg, {"steps": 2}, engine=engine)["state"]
    engine.save_checkpoint(path, tag="t")
    dist.barrier()
    rebuilt = get_fp32_state_dict_from_zero_checkpoint(path, tag="t")
    return rel_error(rebuilt, state), sorted(set(state) ^ set(rebuilt))


def test_zero_to_fp32_with_an_empty_group_frozen_and_zero_element_params(tmp_path):
    for err, diff in run_distributed(_empty_group_checkpoint, world_size=3, args=(str(tmp_path),), timeout=60):
        assert diff == [] and err == 0.0


def _mixed_dtype_error() -> str:
    import deepspeed

    model = make_model()
    model.big.to(torch.bfloat16)
    try:
        deepspeed.initialize(model=model, config=zcfg({"stage": 2}))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mixed_dtype_group_is_a_clear_error():
    message = run_distributed(_mixed_dtype_error, world_size=2, timeout=60)[0]
    assert "torch.bfloat16" in message and "torch.float32" in message and "(8, 8)" in message


def _full_states(cfg: dict, path: str, save: bool) -> dict:
    """World A trains 2 steps and saves; world B loads. Both return weights and every full exp_avg/exp_avg_sq."""
    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state

    model = make_model(seed=dist.get_rank() + (0 if save else 100), empty=True)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, **_optimizer_kwargs(model, "groups"))
    if save:
        train(cfg, {"steps": 2}, engine=engine)
        engine.save_checkpoint(path, tag="t")
    else:
        engine.load_checkpoint(path, tag="t")
    states = {f"{n}.{key}": safe_get_full_optimizer_state(p, key).clone()
              for n, p in engine.module.named_parameters() for key in ("exp_avg", "exp_avg_sq")}
    weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return {"states": states, "weights": weights, "lr": engine.get_lr(), "steps": engine.global_steps}


def test_resume_from_two_ranks_onto_three_with_round_robin_and_groups(tmp_path):
    save = zcfg({"stage": 2, "reduce_bucket_size": 30}, scheduler=WARMUP)
    load = zcfg({"stage": 1, "round_robin_gradients": True}, scheduler=WARMUP)
    before = run_distributed(_full_states, world_size=2, args=(save, str(tmp_path), True), timeout=60)[0]
    for after in run_distributed(_full_states, world_size=3, args=(load, str(tmp_path), False), timeout=60):
        assert rel_error(after["weights"], before["weights"]) == 0.0
        assert rel_error(after["states"], before["states"]) == 0.0
        assert after["lr"] == before["lr"] and after["steps"] == before["steps"] == 2


CPU_ADAMW = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}}  # offload -> DeepSpeedCPUAdam


@pytest.mark.parametrize("how", ["frozen_group", "subset"])
def test_cpu_offload_with_empty_group_and_unused_params_matches_stage0(how):
    zero = {"stage": 2, "reduce_bucket_size": 30, "overlap_comm": True, "offload_optimizer": {"device": "cpu"}}
    run = {"params": how, "side": "rank0", "gas": 2, "steps": 3}
    got = run_world({**zcfg(zero, gradient_clipping=0.5), "optimizer": CPU_ADAMW}, run)
    base = run_world(zcfg({"stage": 0}, gradient_clipping=0.5), run)
    assert rel_error(got[1]["state"], got[0]["state"]) == 0.0
    assert rel_error(got[0]["state"], base[0]["state"]) <= 1e-5  # DeepSpeedCPUAdam against torch AdamW

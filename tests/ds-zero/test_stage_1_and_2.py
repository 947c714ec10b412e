"""ZeRO stages 1 and 2 through ``deepspeed.initialize`` on gloo ranks: each variant (stage 1, stage 2, stage 2 +
overlap_comm, stage 2 + CPU optimizer offload) trains to the weights, losses and gradient norms of stage 0 and of
a single-process torch reference, in fp32, bf16 and fp16 (overflow skipped on every rank), with gradient
accumulation, clipping, the gradient-communication options, frozen parameters, parameter groups, a client
optimizer and tied weights. Reducer/gather options, no_sync and coalesce_grad_reduction live in
``test_stage_1_and_2_options.py``.

Tolerances (relative error of each weight tensor as a whole; measured on torch 2.13 CPU, 2 and 4 gloo ranks,
GAS 2, clipping): fp32 against the reference and stage 0 <= 1.1e-7 (CPU offload, DeepSpeedCPUAdam against torch
AdamW: 2.4e-6), bound 1e-5 as specified. bf16 against bf16 stage 0: stage 1 bit-exact (it reduces once per
window, like stage 0), stage 2 2.8e-3 (it reduces every micro batch and accumulates averaged bf16 partitions,
where stage 0 sums locally then reduces once: different roundings), bound ``BF16_BOUND`` = 1e-2. fp16 against
fp16 stage 0: stage 1 bit-exact, stage 2 2.3e-4, bound ``FP16_BOUND`` = 1e-3. communication_data_type fp16/bf16
against stage 0: stage 1 bit-exact, stage 2 <= 1.9e-3 (bf16, 4 ranks), bound 5e-3.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

IN, HID, OUT = 6, 12, 3
VOCAB, DIM, SEQ = 10, 8, 3
BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6}
ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}
CPU_ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}  # offload -> DeepSpeedCPUAdam
CLIP = 0.8  # inside the range of the MLP task's gradient norms (0.3 to 1.9): clipping really happens
VARIANTS = {
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage2_overlap": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 40},  # several async buckets
    "stage2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}


# ---- models and data ---------------------------------------------------------------------------------------
class Frozen(torch.nn.Module):
    """An MLP whose first layer is frozen (requires_grad False): it must stay untouched and in the model."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(IN, HID)
        self.first.requires_grad_(False)
        self.second = torch.nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


class Unused(torch.nn.Module):
    """An MLP with a parameter that never takes part in the forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class Tied(torch.nn.Module):
    """A tiny language model whose output projection shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.hidden = torch.nn.Linear(DIM, DIM)
        self.out = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(ids))))


def make_model(kind: str = "mlp", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))
    return {"frozen": Frozen, "unused": Unused, "tied": Tied}[kind]()


def batches(kind: str, steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "tied":
        return [(torch.randint(VOCAB, (batch, SEQ), generator=gen), torch.randint(VOCAB, (batch, SEQ), generator=gen))
                for _ in range(steps)]
    return [(torch.randn(batch, IN, generator=gen), torch.randn(batch, OUT, generator=gen)) for _ in range(steps)]


def loss_of(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "tied":
        return torch.nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), y.reshape(-1))
    return torch.nn.functional.mse_loss(out.float(), y)


def two_groups(model: torch.nn.Module) -> list[dict]:
    """Two parameter groups with different lr and weight decay (first layer / last layer of the MLP)."""
    return [{"params": list(model[0].parameters()), "lr": 0.01, "weight_decay": 0.0},
            {"params": list(model[2].parameters()), "lr": 0.03, "weight_decay": 0.2}]


# ---- the rank body and the reference ----------------------------------------------------------------------------
def engine_run(config: dict, run: dict) -> dict:
    """Train through deepspeed.initialize. ``run``: kind, steps, gas, and optionally ``inject`` (the step at which
    rank 0's first micro batch gets an inf), ``groups`` ("config": model_parameters with two groups, "client": a
    torch AdamW over two groups), ``client`` (a torch AdamW over all parameters). Rank r takes its slice of each
    global batch; returns the weights, per-step local losses, norms, loss scales and skip counts."""
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    kind, steps, gas = run.get("kind", "mlp"), run.get("steps", 20), run.get("gas", 1)
    micro = BASE["train_micro_batch_size_per_gpu"]
    model = make_model(kind, seed=rank)  # a different init per rank: the engine broadcasts rank 0's
    kwargs: dict = {}
    if run.get("groups") == "config":
        kwargs["model_parameters"] = two_groups(model)
    elif run.get("groups") == "client":
        kwargs["optimizer"] = torch.optim.AdamW(two_groups(model))
    elif run.get("client"):
        kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, config={**config, "gradient_accumulation_steps": gas},
                                           **kwargs)
    dtype, device = next(engine.parameters()).dtype, next(engine.parameters()).device
    out = {"losses": [], "norms": [], "scales": [], "skipped": [], "changed": []}
    for step, (x, y) in enumerate(batches(kind, steps, micro * gas * world)):
        before = whole_state(engine)
        losses = []
        for g in range(gas):
            lo = (g * world + rank) * micro
            xs = x[lo:lo + micro].to(device, copy=True)
            if xs.is_floating_point():
                xs = xs.to(dtype)
                if step == run.get("inject") and g == 0 and rank == 0:
                    xs[0, 0] = math.inf  # tanh saturates: 0 * inf = nan in the first layer's weight gradient
            loss = loss_of(kind, engine(xs), y[lo:lo + micro].to(device))
            losses.append(float(loss.detach()))
            engine.backward(loss)
            engine.step()
        out["losses"].append(losses)
        out["norms"].append(engine.get_global_grad_norm())
        out["scales"].append(engine.get_loss_scale())
        out["skipped"].append(engine.skipped_steps)
        after = whole_state(engine)
        out["changed"].append(any(not torch.equal(before[k], v) for k, v in after.items()))
    out["state"] = whole_state(engine)
    out["types"] = (type(engine.optimizer).__name__, type(engine.optimizer.optimizer).__name__)
    out["lrs"] = engine.get_lr()
    reducer = getattr(engine.optimizer, "reducer", None)
    out["buckets"] = len(reducer.buckets) if reducer is not None else None
    groups = getattr(engine.optimizer, "groups", None)
    out["devices"] = (str(device), str(groups[0].master.device) if groups else None)
    return out


def whole_state(engine) -> dict:
    """The module's whole weights and buffers as float CPU tensors (ZeRO-3 parameters gathered for the read)."""
    import deepspeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
        return {k: v.detach().float().cpu().clone() for k, v in named}


def reference_run(run: dict, clip: float = 0.0) -> dict:
    """One process, the whole global batch per step, torch AdamW (lr 0.01, weight decay 0.01 unless groups).
    ``run``: batch, and optionally kind, steps, groups, weight_decay, loss_factor (the loss is multiplied by it)."""
    kind, steps, batch = run.get("kind", "mlp"), run.get("steps", 20), run["batch"]
    model = make_model(kind, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = two_groups(model) if run.get("groups") else params
    opt = torch.optim.AdamW(groups, lr=0.01, weight_decay=run.get("weight_decay", 0.01))
    losses, norms = [], []
    for x, y in batches(kind, steps, batch):
        opt.zero_grad()
        loss = loss_of(kind, model(x), y)
        (loss * run.get("loss_factor", 1.0)).backward()  # several backward calls per step sum their gradients
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip else math.inf)))
        opt.step()
    return {"state": model.state_dict(), "losses": losses, "norms": norms}


def rel_error(got: dict, want: dict) -> float:
    """Largest relative error over the tensors of two state dicts (each tensor as a whole)."""
    worst = 0.0
    for key, value in want.items():
        diff = float((got[key].float() - value.float()).norm())
        worst = max(worst, diff / max(float(value.float().norm()), 1e-12))
    return worst


def global_losses(results: list[dict]) -> list[float]:
    """Per step: the mean over ranks and micro batches (equal micro batches: the global batch's mean loss)."""
    steps = len(results[0]["losses"])
    return [sum(sum(r["losses"][s]) for r in results) / sum(len(r["losses"][s]) for r in results)
            for s in range(steps)]


def zero_config(zero: dict, optimizer: dict | None = None, **extra) -> dict:
    return {**BASE, "optimizer": optimizer or (CPU_ADAMW if "offload_optimizer" in zero else ADAMW),
            "zero_optimization": zero, **extra}


def train(config: dict, world: int, **run) -> list[dict]:
    return run_distributed(engine_run, world_size=world, args=(config, run), timeout=60)


def assert_ranks_agree(results: list[dict]) -> None:
    for r in results[1:]:
        assert rel_error(r["state"], results[0]["state"]) == 0.0, "ranks ended with different weights"


# ---- fp32: every variant against stage 0 and the reference ------------------------------------------------------
@pytest.mark.parametrize(("variant", "world", "gas"), [
    ("stage1", 2, 3), ("stage2", 2, 3), ("stage2_overlap", 2, 2), ("stage2_offload", 2, 4),
    ("stage1", 4, 2), ("stage2_overlap", 4, 2), ("stage2", 1, 2), ("stage2_offload", 1, 1)])
def test_fp32_matches_stage0_and_reference(variant, world, gas):
    zero = VARIANTS[variant]
    got = train(zero_config(zero, gradient_clipping=CLIP), world, gas=gas)
    base = train(zero_config({"stage": 0}, gradient_clipping=CLIP), world, gas=gas)
    ref = reference_run({"batch": 2 * gas * world}, clip=CLIP)
    assert got[0]["types"][0] == "DeepSpeedZeroOptimizer"
    if variant == "stage2_offload":
        assert got[0]["types"][1] == "DeepSpeedCPUAdam"
    assert_ranks_agree(got)
    assert max(ref["norms"]) > CLIP  # clipping really happened
    assert rel_error(got[0]["state"], ref["state"]) <= 1e-5
    assert rel_error(got[0]["state"], base[0]["state"]) <= 1e-5
    assert global_losses(got) == pytest.approx(ref["losses"], rel=1e-5)
    assert global_losses(got) == pytest.approx(global_losses(base), rel=1e-5)
    # the global norm across partitions is clip_grad_norm_'s total norm (before clipping)
    assert got[0]["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert [r["norms"] for r in got] == [got[0]["norms"]] * world


# ---- bf16 and fp16 against stage 0 of the same precision -------------------------------------------------------
BF16_BOUND = 1e-2  # measured at most 2.8e-3 (stage 2); see the module docstring


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_matches_bf16_stage0(variant):
    extra = {"bf16": {"enabled": True}, "gradient_clipping": CLIP}
    got = train(zero_config(VARIANTS[variant], **extra), 2, gas=2)
    base = train(zero_config({"stage": 0}, **extra), 2, gas=2)
    ref = reference_run({"batch": 8}, clip=CLIP)
    assert_ranks_agree(got)
    assert rel_error(got[0]["state"], base[0]["state"]) <= BF16_BOUND
    assert global_losses(got) == pytest.approx(global_losses(base), rel=BF16_BOUND)
    assert got[0]["norms"] == pytest.approx(base[0]["norms"], rel=BF16_BOUND)
    # and bf16 training stays near the fp32 reference (bf16 weights: about 3 significant digits)
    assert rel_error(got[0]["state"], ref["state"]) <= 5e-2


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_fp32_grad_accumulation_matches_stage0(stage):
    extra = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    got = train(zero_config({"stage": stage}, **extra), 2, gas=4, steps=10)
    base = train(zero_config({"stage": 0}, **extra), 2, gas=4, steps=10)
    assert_ranks_agree(got)
    assert rel_error(got[0]["state"], base[0]["state"]) <= BF16_BOUND
    assert global_losses(got) == pytest.approx(global_losses(base), rel=BF16_BOUND)


FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}
FP16_BOUND = 1e-3  # measured at most 2.3e-4 (stage 2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp16_overflow_is_skipped_on_every_rank(variant):
    inject, steps = 3, 8
    extra = {"fp16": FP16, "gradient_clipping": CLIP}
    got = train(zero_config(VARIANTS[variant], **extra), 2, gas=2, steps=steps, inject=inject)
    base = train(zero_config({"stage": 0}, **extra), 2, gas=2, steps=steps, inject=inject)
    for r in got:  # only rank 0 saw the inf; every rank skipped the step and halved the scale
        assert r["changed"] == [s != inject for s in range(steps)]
        assert r["skipped"] == [int(s >= inject) for s in range(steps)]
        assert r["scales"] == [256.0 if s < inject else 128.0 for s in range(steps)]
        assert r["norms"][inject] is None
    assert_ranks_agree(got)
    assert got[0]["skipped"] == base[0]["skipped"] and got[0]["scales"] == base[0]["scales"]
    assert rel_error(got[0]["state"], base[0]["state"]) <= FP16_BOUND
    clean = [s for s in range(steps) if s != inject]
    assert [got[0]["norms"][s] for s in clean] == pytest.approx([base[0]["norms"][s] for s in clean], rel=FP16_BOUND)


# ---- gradient-communication options against stage 0 with the same options --------------------------------------
@pytest.mark.parametrize("options", [
    {"communication_data_type": "fp16"}, {"communication_data_type": "bf16"}, {"communication_data_type": "fp32"},
    {"prescale_gradients": True}, {"gradient_predivide_factor": 2.0}])
@pytest.mark.parametrize("stage", [1, 2])
def test_communication_options_match_stage0(stage, options):
    got = train(zero_config({"stage": stage}, **options), 2, gas=2, steps=10)
    base = train(zero_config({"stage": 0}, **options), 2, gas=2, steps=10)
    ref = reference_run({"batch": 8, "steps": 10})
    assert_ranks_agree(got)
    low = options.get("communication_data_type") in ("fp16", "bf16")
    assert rel_error(got[0]["state"], base[0]["state"]) <= (5e-3 if low else 1e-6)
    assert rel_error(got[0]["state"], ref["state"]) <= (2e-2 if low else 1e-5)


# ---- parameters: frozen, groups, client optimizer, tied weights -------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2])
def test_frozen_parameters_untouched_and_rest_matches_reference(stage):
    got = train(zero_config({"stage": stage}), 2, kind="frozen", steps=10)
    ref = reference_run({"batch": 4, "steps": 10, "kind": "frozen"})
    init = make_model("frozen", seed=0).state_dict()
    for r in got:
        assert set(r["state"]) == set(init)  # still in the model
        for key in ("first.weight", "first.bias"):
            assert torch.equal(r["state"][key], init[key])
    assert not torch.equal(got[0]["state"]["second.weight"], init["second.weight"])
    assert rel_error(got[0]["state"], ref["state"]) <= 1e-5


@pytest.mark.parametrize("how", ["config", "client"])
@pytest.mark.parametrize("stage", [1, 2])
def test_two_parameter_groups_match_reference(stage, how):
    got = train(zero_config({"stage": stage}), 2, groups=how, steps=10)
    ref = reference_run({"batch": 4, "steps": 10, "groups": True})
    plain = reference_run({"batch": 4, "steps": 10})
    assert_ranks_agree(got)
    assert rel_error(got[0]["state"], ref["state"]) <= 1e-5
    assert rel_error(got[0]["state"], plain["state"]) > 1e-3  # the group settings really mattered
    assert got[0]["lrs"] == [0.01, 0.03]


@pytest.mark.parametrize("stage", [1, 2])
def test_client_torch_optimizer(stage):
    got = train(zero_config({"stage": stage}), 2, client=True, steps=10)
    ref = reference_run({"batch": 4, "steps": 10})
    assert got[0]["types"] == ("DeepSpeedZeroOptimizer", "AdamW")
    assert rel_error(got[0]["state"], ref["state"]) <= 1e-5


@pytest.mark.parametrize(("stage", "world"), [(1, 2), (2, 2), (2, 4)])
def test_tied_weights_train_like_reference(stage, world):
    got = train(zero_config({"stage": stage}, gradient_clipping=CLIP), world, kind="tied", gas=2, steps=10)
    ref = reference_run({"batch": 4 * world, "steps": 10, "kind": "tied"}, clip=CLIP)
    assert_ranks_agree(got)
    assert torch.equal(got[0]["state"]["embed.weight"], got[0]["state"]["out.weight"])
    assert rel_error(got[0]["state"], ref["state"]) <= 1e-5
    assert global_losses(got) == pytest.approx(ref["losses"], rel=1e-5)
    assert got[0]["norms"] == pytest.approx(ref["norms"], rel=1e-5)


# ---- CUDA (one GPU: one NCCL rank; the data-parallel paths are covered on gloo above) --------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_bf16_matches_stage0(variant):
    extra = {"bf16": {"enabled": True}, "gradient_clipping": CLIP}

    def run(zero):
        return run_distributed(engine_run, world_size=1, args=(zero_config(zero, **extra), {"gas": 2}),
                               backend="nccl", timeout=120)[0]

    got, base = run(VARIANTS[variant]), run({"stage": 0})
    offload = "offload_optimizer" in VARIANTS[variant]
    assert got["devices"] == ("cuda:0", "cpu" if offload else "cuda:0")
    assert rel_error(got["state"], base["state"]) <= BF16_BOUND
    assert got["norms"] == pytest.approx(base["norms"], rel=BF16_BOUND)

"""The stage-0 engine against a single-process torch reference of the same global batch (2 and 4 gloo ranks),
gradient accumulation, clipping, no_sync, the reducers, and the LR schedules through the engine."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

IN, HID, OUT = 6, 12, 3


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def global_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, IN, generator=gen), torch.randn(batch, OUT, generator=gen)) for _ in range(steps)]


def engine_run(config: dict, steps: int, micro: int, gas: int, seed_offset_per_rank: bool = True) -> dict:
    """Train with deepspeed.initialize; rank r takes its slice of each global batch. Returns state + norms."""
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    # different init per rank: the engine must broadcast rank 0's weights
    model = make_model(seed=rank if seed_offset_per_rank else 0)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    norms, lrs = [], []
    for x, y in global_batches(steps, micro * gas * world):
        for g in range(gas):
            lo = (g * world + rank) * micro
            loss = torch.nn.functional.mse_loss(engine(x[lo:lo + micro]), y[lo:lo + micro])
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
        lrs.append(engine.get_lr()[0])
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {"state": state, "norms": norms, "lrs": lrs, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "micro_steps": engine.micro_steps}


def reference_run(make_opt, steps: int, batch: int, clip: float = 0.0, schedule=None) -> dict:
    model = make_model(0)
    opt = make_opt(model.parameters())
    sched = schedule(opt) if schedule else None
    norms = []
    for x, y in global_batches(steps, batch):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched:
            sched.step()
    return {"state": model.state_dict(), "norms": norms}


def assert_close_states(got: dict, want: dict, rtol: float) -> None:
    """Relative error of each tensor, as a whole: ||got - want|| <= rtol * ||want||."""
    for key, value in want.items():
        error = float((got[key].float() - value.float()).norm() / value.float().norm())
        assert error <= rtol, f"{key}: relative error {error:.3g} > {rtol:g}"


SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process_reference(world):
    steps, micro = 20, 2
    config = {"train_micro_batch_size_per_gpu": micro, "optimizer": SGD, "steps_per_print": 1000}
    results = run_distributed(engine_run, world_size=world, args=(config, steps, micro, 1), timeout=60)
    ref = reference_run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps, micro * world)
    for r in results:  # every rank ends with the reference's weights
        assert_close_states(r["state"], ref["state"], rtol=1e-6)
    assert results[0]["global_steps"] == steps and results[0]["global_samples"] == steps * micro * world


def test_adamw_matches_reference_and_gas_equivalence():
    steps = 20
    gas2 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": ADAMW,
            "steps_per_print": 1000}
    gas1 = {**gas2, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    a = run_distributed(engine_run, world_size=2, args=(gas2, steps, 2, 2), timeout=60)[0]
    b = run_distributed(engine_run, world_size=2, args=(gas1, steps, 4, 1), timeout=60)[0]
    assert a["micro_steps"] == 2 * steps and a["global_steps"] == steps == b["global_steps"]
    assert a["global_samples"] == b["global_samples"] == 8 * steps
    ref = reference_run(lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01), steps, 8)
    assert_close_states(a["state"], b["state"], rtol=1e-5)
    assert_close_states(a["state"], ref["state"], rtol=1e-5)


def test_gradient_clipping_matches_clip_grad_norm():
    steps, clip = 10, 0.05
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "gradient_clipping": clip,
              "steps_per_print": 1000}
    got = run_distributed(engine_run, world_size=2, args=(config, steps, 2, 1), timeout=60)[0]
    ref = reference_run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps, 4, clip=clip)
    assert max(ref["norms"]) > clip  # clipping really happened
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert_close_states(got["state"], ref["state"], rtol=1e-5)


@pytest.mark.parametrize("options", [{}, {"prescale_gradients": True}, {"gradient_predivide_factor": 2.0},
                                     {"communication_data_type": "bf16"}, {"fp32_allreduce": True}])
def test_reduction_options_match_reference(options):
    steps = 6
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000, **options}
    got = run_distributed(engine_run, world_size=2, args=(config, steps, 2, 1), timeout=60)[0]
    ref = reference_run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps, 4)
    rtol = 2e-2 if options.get("communication_data_type") == "bf16" else 1e-6
    assert_close_states(got["state"], ref["state"], rtol=rtol)


def _reducers_agree(options: dict) -> list[float]:
    from deepspeed.runtime.grad_reduce import BucketedAllReduce, ReduceOptions, ReferenceAllReduce
    from deepspeed.runtime.precision.optimizers import FP32Optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for cls in (BucketedAllReduce, ReferenceAllReduce):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 300_000, 7, 50)]
        gen = torch.Generator().manual_seed(100 + rank)
        for i, p in enumerate(params):
            p.grad = None if i == 2 and rank == 0 else torch.randn(p.shape, generator=gen)
        wrapper = FP32Optimizer(torch.optim.SGD(params, lr=0.1))
        kwargs = {"bucket_bytes": 64} if cls is BucketedAllReduce else {}
        reducer = cls(params, wrapper, ReduceOptions(world_size=world, **options), **kwargs)
        for p in reversed(params[1:]):  # one gradient "never lands" on this rank: finish() covers it
            reducer.grad_ready(p)
        reducer.finish()
        out.append(torch.cat([p.grad.reshape(-1) for p in params]))
    low = options.get("communication_data_type") not in (None, torch.float32)
    # fp16 sums of 4 ranks may round differently in gloo's ring (large buffer) and pairwise (small) orders
    torch.testing.assert_close(out[0], out[1], rtol=2e-3 if low else 1e-6, atol=2e-3 if low else 1e-7)
    gen_all = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    expected = sum(torch.randn(3, generator=g) for g in gen_all) / world
    torch.testing.assert_close(out[1][:3], expected, rtol=2e-3 if low else 1e-5, atol=2e-3 if low else 1e-6)
    return out[0][:3].tolist()


@pytest.mark.parametrize("options", [{}, {"prescale_gradients": True}, {"gradient_predivide_factor": 4.0},
                                     {"communication_data_type": torch.float16}])
def test_bucketed_reducer_agrees_with_reference(options):
    results = run_distributed(_reducers_agree, world_size=4, args=(options,), timeout=60)
    assert all(r == results[0] for r in results)


def _no_sync_body() -> dict:
    import deepspeed

    rank = dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000}
    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    x = torch.randn(2, IN) + rank  # different data on each rank
    weight = engine.module[0].weight

    def grads_after_backward():
        engine.backward(engine(x).pow(2).mean())
        g = weight.grad.clone()
        gathered = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, g)
        engine.zero_grad()
        return all(torch.equal(gathered[0], t) for t in gathered)

    with engine.no_sync():
        local = grads_after_backward()
    synced = grads_after_backward()
    return {"local_equal": local, "synced_equal": synced}


def test_no_sync_skips_reduction():
    for r in run_distributed(_no_sync_body, world_size=2, timeout=60):
        assert r == {"local_equal": False, "synced_equal": True}


SCHEDULES = {
    "LRRangeTest": {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 1.0},
    "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3},
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 4},
    "WarmupDecayLR": {"total_num_steps": 10, "warmup_max_lr": 0.05, "warmup_num_steps": 3},
    "WarmupCosineLR": {"total_num_steps": 10, "warmup_num_steps": 3},
}


def _schedules_body() -> dict:
    import deepspeed
    from deepspeed.runtime import lr_schedules

    out = {}
    for name, params in SCHEDULES.items():
        config = {"train_batch_size": 2, "steps_per_print": 1000, "scheduler": {"type": name, "params": params},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}
        engine, _, _, sched = deepspeed.initialize(model=make_model(0), config=config)
        expected_opt = torch.optim.SGD(make_model(0).parameters(), lr=0.05, momentum=0.9)
        expected = getattr(lr_schedules, name)(expected_opt, **params)
        got, want = [], []
        for _ in range(7):
            engine.backward(engine(torch.randn(2, IN)).sum())
            engine.step()
            expected.step()
            got.append(engine.get_lr()[0])
            want.append(expected_opt.param_groups[0]["lr"])
        out[name] = (got, want, engine.lr_scheduler is sched)
    return out


def test_each_lr_schedule_through_the_engine():
    result = run_distributed(_schedules_body, world_size=1, timeout=60)[0]
    for name, (got, want, same) in result.items():
        assert same, name
        assert got == pytest.approx(want, rel=1e-12), name
        assert len(set(got)) > 1, name  # the schedule really moved


class Checkpointed(torch.nn.Module):
    """The whole model under reentrant activation checkpointing: every gradient lands in a nested backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)


def _checkpointed_body() -> dict:
    import deepspeed

    rank = dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000}
    engine, _, _, _ = deepspeed.initialize(model=Checkpointed(), config=config)
    for x, y in global_batches(5, 4):
        xs = x[2 * rank:2 * rank + 2].requires_grad_()  # reentrant checkpointing needs an input with grad
        engine.backward(torch.nn.functional.mse_loss(engine(xs), y[2 * rank:2 * rank + 2]))
        engine.step()
    return {k.removeprefix("inner."): v.clone() for k, v in engine.module.state_dict().items()}


def test_reentrant_activation_checkpointing_reduces_every_gradient():
    got = run_distributed(_checkpointed_body, world_size=2, timeout=60)[0]
    ref = reference_run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 5, 4)
    assert_close_states(got, ref["state"], rtol=1e-6)


class Branchy(torch.nn.Module):
    """``extra`` is used only when asked: some micro-steps (and some ranks) leave it without a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model(0)
        torch.manual_seed(3)
        self.extra = torch.nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


def _branchy_engine(steps: int) -> dict:
    import deepspeed

    rank = dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": SGD,
              "steps_per_print": 1000}
    engine, _, _, _ = deepspeed.initialize(model=Branchy(), config=config)
    for step, (x, y) in enumerate(global_batches(steps, 8)):
        for g in range(2):
            lo = (g * 2 + rank) * 2
            use = g == 0 and (rank == 0 or step % 2 == 0)  # never on the boundary micro-step; rank 1 skips some
            engine.backward(torch.nn.functional.mse_loss(engine(x[lo:lo + 2], use), y[lo:lo + 2]))
            engine.step()
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def test_parameters_unused_in_some_micro_steps_and_ranks():
    steps = 6
    got = run_distributed(_branchy_engine, world_size=2, args=(steps,), timeout=60)[0]
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(global_batches(steps, 8)):
        opt.zero_grad()
        loss = 0
        for g in range(2):
            for rank in range(2):
                lo = (g * 2 + rank) * 2
                use = g == 0 and (rank == 0 or step % 2 == 0)
                loss = loss + torch.nn.functional.mse_loss(model(x[lo:lo + 2], use), y[lo:lo + 2]) / 4
        loss.backward()
        opt.step()
    assert_close_states(got, model.state_dict(), rtol=1e-6)


def _compiled_body(steps: int) -> dict:
    import deepspeed

    rank = dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000,
              "compile": {"enabled": True, "backend": "aot_eager"}}
    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    for x, y in global_batches(steps, 4):
        engine.backward(torch.nn.functional.mse_loss(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
        engine.step()
    return {"compiled": engine.is_compiled, "state": {k: v.clone() for k, v in engine.module.state_dict().items()}}


def test_compiled_module_trains_like_the_reference():
    got = run_distributed(_compiled_body, world_size=2, args=(4,), timeout=120)[0]
    ref = reference_run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 4, 4)
    assert got["compiled"]
    assert_close_states(got["state"], ref["state"], rtol=1e-6)


class SparseEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(20, OUT, sparse=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed(idx)


def _sparse_body(clip: float) -> dict:
    import deepspeed

    rank = dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": 3, "steps_per_print": 1000, "gradient_clipping": clip,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    engine, _, _, _ = deepspeed.initialize(model=SparseEmbedding(), config=config)
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        idx = torch.randint(0, 20, (6,), generator=gen)
        engine.backward(engine(idx[3 * rank:3 * rank + 3]).pow(2).mean())
        engine.step()
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.parametrize("clip", [0.0, 0.01])
def test_sparse_embedding_gradients(clip):
    got = run_distributed(_sparse_body, world_size=2, args=(clip,), timeout=60)[0]
    model = SparseEmbedding()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        idx = torch.randint(0, 20, (6,), generator=gen)
        opt.zero_grad()
        (model(idx[:3]).pow(2).mean() / 2 + model(idx[3:]).pow(2).mean() / 2).backward()
        if clip:
            grad = model.embed.weight.grad.coalesce()
            norm = float(grad.values().norm())
            if norm > clip:
                model.embed.weight.grad = grad * (clip / (norm + 1e-6))
        opt.step()
    assert_close_states(got, model.state_dict(), rtol=1e-6)

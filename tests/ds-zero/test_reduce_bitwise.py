"""ZeRO stage 1/2 gradient reduction is bit-exact whatever the bucketing and concurrency options say.

On 2 gloo ranks every reduced element is ``(mine + peer's) * factor`` (fp32 and bf16 addition of two values is
commutative, so the order the two copies meet in does not matter), added into the gradient partition: the point to
point exchange of ``ds_zero._reduce`` (one bucket or many, ``overlap_comm`` on or off, pooled or fresh buffers), the
per-owner ``reduce`` and gloo's own ``all_reduce`` (``reduce_scatter: false``, the plain reference) must leave the
same bytes. Each case trains a few steps through ``deepspeed.initialize`` with gradient accumulation 1 and 2 and
compares every step's loss and the final weights, exactly, with the reference; the MoE case adds an expert group
reduced over its own process group (ep_size 1: the expert-data-parallel group spans both ranks). On 4 ranks the
exchange receives the peers' copies one peer at a time: every bucketing must still give the same bytes.
Stage 1 on the CPU sends a bucket straight from the store that holds its full gradients (``direct``: no copy into a
communication buffer, sums into the staging buffer); ``packed`` forces the copy path it replaced on the same
buckets, and the direct buckets must leave the same bytes, with fp16 loss scaling, CPU offload (DeepSpeedCPUAdam)
and a second backward at the boundary (which re-reduces the local gradient the first reduction must have left
intact) too.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

STEPS, MICRO, SMALL_BUCKET = 3, 2, 300  # the MLP has 1,379 elements: a 300-element bucket spans both partitions
REFERENCE = {"reduce_scatter": False}  # gloo all_reduce of the whole bucket, then this rank's slices
OPTIONS = {
    "one_bucket": {},
    "small_buckets": {"reduce_bucket_size": SMALL_BUCKET},
    "overlap": {"reduce_bucket_size": SMALL_BUCKET, "overlap_comm": True},
    "fresh_buffers": {"reduce_bucket_size": SMALL_BUCKET, "contiguous_gradients": False},
    "overlap_fresh": {"reduce_bucket_size": SMALL_BUCKET, "overlap_comm": True, "contiguous_gradients": False},
    "reduce_per_owner": {"reduce_bucket_size": SMALL_BUCKET, "use_multi_rank_bucket_allreduce": False},
    "packed": {"reduce_bucket_size": SMALL_BUCKET},  # stage 1: the direct buckets forced onto the copy path
}
ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}}


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 3))


class _MoENet(torch.nn.Module):
    def __init__(self) -> None:
        from ds_moe import MoE

        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        self.moe = MoE(8, expert, num_experts=2, ep_size=1, k=1, min_capacity=1, drop_tokens=False)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h).float().pow(2).mean() + 0.1 * l_aux


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train(zero: dict, gas: int, extra: dict, moe: bool, packed: bool = False, double: bool = False) -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = _MoENet() if moe else _mlp()
    kwargs: dict = {}
    if moe:
        from ds_moe.utils import split_params_into_different_moe_groups_for_optimizer

        kwargs["model_parameters"] = split_params_into_different_moe_groups_for_optimizer(
            [{"params": list(model.parameters()), "name": "dense"}])
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
              "gradient_clipping": 0.5, "zero_optimization": zero, "optimizer": ADAMW, **extra}
    engine, *_ = deepspeed.initialize(model=model, config=config, **kwargs)
    buckets = engine.optimizer.reducer.buckets
    direct = sum(b.direct for b in buckets)
    if packed:
        for b in buckets:
            b.direct = False
    dtype = next(engine.parameters()).dtype
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(STEPS * gas):
        x = torch.randn(MICRO, 6, generator=gen).to(dtype)
        out = engine(x)
        loss = out if moe else (out.float() - 1.0).pow(2).mean()
        if double:  # the same loss twice (retain_graph): at the boundary stage 1 reduces both times
            engine.backward(loss, retain_graph=True)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "weights": _digest([p for p in engine.module.parameters()]), "buckets": len(buckets),
            "direct": direct}


def _every_option(stage: int, extra: dict, moe: bool, names: tuple[str, ...] = ("reference", *OPTIONS)) -> dict:
    options = {"reference": REFERENCE, **OPTIONS}
    return {(gas, name): _train({"stage": stage, **options[name]}, gas, extra, moe, packed=name == "packed")
            for gas in (1, 2) for name in names}


def _check(results: list[dict], reference: str = "reference", stage: int | None = None, direct: bool = True) -> None:
    for key, got in results[0].items():  # every rank holds the same weights
        assert all(got["weights"] == r[key]["weights"] for r in results[1:]), key
    for (gas, name), got in results[0].items():
        want = results[0][gas, reference]
        assert got["losses"] == want["losses"], (gas, name)
        assert got["weights"] == want["weights"], (gas, name)
    assert results[0][1, "small_buckets"]["buckets"] > 2  # several buckets really were in flight
    if stage is not None:  # the point-to-point options of stage 1 really sent from the store (stage 2 never does)
        sent_direct = {name: got["direct"] for (gas, name), got in results[0].items() if gas == 1}
        assert sent_direct.get("reference", 0) == 0 and sent_direct.get("reduce_per_owner", 0) == 0
        expect = stage == 1 and direct
        assert (sent_direct["small_buckets"] == results[0][1, "small_buckets"]["buckets"]) == expect, sent_direct


@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_reduction_is_bit_exact_for_every_option(stage):
    _check(run_distributed(_every_option, world_size=2, args=(stage, {}, False), timeout=120), stage=stage)


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_and_predivide_reduction_is_bit_exact_for_every_option(stage):
    extra = {"bf16": {"enabled": True}, "gradient_predivide_factor": 2.0}  # a factor before the sum: packed
    _check(run_distributed(_every_option, world_size=2, args=(stage, extra, False), timeout=120), stage=stage,
           direct=False)


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_loss_scaled_reduction_is_bit_exact_for_every_option(stage):
    extra = {"fp16": {"enabled": True, "initial_scale_power": 8}}
    _check(run_distributed(_every_option, world_size=2, args=(stage, extra, False), timeout=120), stage=stage)


def _offload_and_double(stage: int) -> dict:
    """(double, gas, option) -> result, with CPU offload (DeepSpeedCPUAdam), one and two backward calls a micro-step."""
    extra = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}
    options = {"reference": REFERENCE, **OPTIONS}
    return {(double, gas, name): _train({"stage": stage, **options[name], "offload_optimizer": {"device": "cpu"}},
                                        gas, extra, False, packed=name == "packed", double=double)
            for double in (False, True) for gas in (1, 2)
            for name in ("reference", "small_buckets", "overlap", "fresh_buffers", "packed")}


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_and_second_backward_reduction_is_bit_exact(stage):
    """CPU offload, and two backward calls per micro-step: at the boundary stage 1 reduces twice, the second time
    the local gradient (which the first reduction must have left as it was) plus the second backward's."""
    results = run_distributed(_offload_and_double, world_size=2, args=(stage,), timeout=180)
    for double in (False, True):
        _check([{key[1:]: got for key, got in r.items() if key[0] == double} for r in results], stage=stage)
    double, single = results[0][True, 1, "small_buckets"], results[0][False, 1, "small_buckets"]
    assert double["losses"][0] == single["losses"][0]  # the same first forward; then twice the gradient moved on
    assert double["weights"] != single["weights"]


@pytest.mark.parametrize("stage", [1, 2])
def test_moe_expert_group_reduction_is_bit_exact_for_every_option(stage):
    _check(run_distributed(_every_option, world_size=2, args=(stage, {}, True), timeout=120), stage=stage)


@pytest.mark.parametrize("stage", [1, 2])
def test_four_rank_exchange_is_the_same_for_every_bucketing(stage):
    """4 ranks: the exchange adds the three peers' copies in rank order (gloo's ring all-reduce adds in another
    order, so it is no reference here): one bucket, many, overlapped or not, pooled or fresh, sent from the store or
    packed, the same bytes."""
    names = ("one_bucket", "small_buckets", "overlap", "fresh_buffers", "overlap_fresh", "packed")
    _check(run_distributed(_every_option, world_size=4, args=(stage, {}, False, names), timeout=120), "one_bucket",
           stage=stage)

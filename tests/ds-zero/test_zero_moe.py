"""ZeRO stages 1 and 2 with MoE parameter groups on gloo ranks: expert groups are partitioned and reduced over
their expert-data-parallel group (gradients divided by the whole data-parallel size), and the clipped global norm
counts every expert once. A model with a 4-expert ``ds_moe`` MoE layer trained with ep_size=2 (2 ranks: each
holds 2 experts, no expert data parallelism; 4 ranks: expert-data-parallel groups of 2) equals the same model
with ep_size=1 (every rank holds every expert) trained by one process (stage 0: plain torch, the data-parallel
average as the mean of every rank's loss): per-rank losses, gradient norms and parameters after N steps, fp32,
rtol 1e-5 (measured: <= 3e-7). Local expert i on expert-parallel rank r is global expert r * 2 + i.
Also: the engine path (``deepspeed.initialize`` with DeepSpeed's MoE parameter groups, gradient accumulation),
the ZeRO-1 ep_size=1 run, and the optimizer-shard checkpoint round trip on the same layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

IN, HID, OUT, EXPERTS = 6, 7, 3, 4  # HID 7: both groups' flat buffers need padding
BATCH, SEQ = 3, 2
STEPS, LR, CLIP, AUX = 4, 0.02, 0.3, 0.1
PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."


class Net(nn.Module):
    def __init__(self, ep_size: int) -> None:
        from ds_moe import MoE

        super().__init__()
        self.inp = nn.Linear(IN, HID)
        expert = nn.Sequential(nn.Linear(HID, 2 * HID), nn.GELU(), nn.Linear(2 * HID, HID))
        self.moe = MoE(HID, expert, num_experts=EXPERTS, ep_size=ep_size, k=2, min_capacity=1, drop_tokens=False,
                       top2_2nd_expert_sampling=False)
        self.out = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h), l_aux


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out, l_aux = model(x)
    return nn.functional.mse_loss(out, y) + AUX * l_aux


def _data(steps: int, world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][rank] -> (x, y)``."""
    gen = torch.Generator().manual_seed(7)
    return [[(torch.randn(BATCH, SEQ, IN, generator=gen) * 2, torch.randn(BATCH, SEQ, OUT, generator=gen))
             for _ in range(world)] for _ in range(steps)]


def _initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: t.clone() for n, t in Net(1).state_dict().items()}


def _global_name(name: str, ep_rank: int, num_local: int) -> str:
    if not name.startswith(PREFIX):
        return name
    local, rest = name[len(PREFIX):].split(".", 1)
    return f"{PREFIX}{ep_rank * num_local + int(local)}.{rest}"


def _expert_model(state: dict[str, torch.Tensor], ep_size: int) -> tuple[Net, int]:
    """This rank's model (its experts loaded from the global ones) and its expert-parallel rank."""
    model = Net(ep_size)
    model.moe.set_deepspeed_parallelism()
    ep_rank = dist.get_rank(group=model.moe.deepspeed_moe.ep_group)
    model.load_state_dict({n: state[_global_name(n, ep_rank, model.moe.num_local_experts)]
                           for n in model.state_dict()})
    return model, ep_rank


def _global_params(model: Net, ep_rank: int) -> dict[str, torch.Tensor]:
    return {_global_name(n, ep_rank, model.moe.num_local_experts): p.detach().clone()
            for n, p in model.named_parameters()}


def _zero_optimizer(model: Net, stage: int, **reduce: object) -> object:
    """A ZeRO stage 1/2 optimizer over DeepSpeed's MoE parameter groups, wired as build_zero_stage does."""
    from deepspeed.runtime.engine._zero import moe_group_comms
    from ds_moe.utils import split_params_into_different_moe_groups_for_optimizer
    from ds_zero.stage_1_and_2 import DeepSpeedZeroOptimizer, ReduceSettings, ZeroSettings

    groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters()),
                                                                    "name": "dense"}])
    inner = torch.optim.AdamW(groups, lr=LR, weight_decay=0.01)
    names = {p: n for n, p in model.named_parameters()}
    settings = ZeroSettings(stage=stage, clip=CLIP, reduce=ReduceSettings(**reduce))
    return DeepSpeedZeroOptimizer(inner, list(model.parameters()), names, settings,
                                  group_comms=moe_group_comms(inner, dist.get_world_size()))


def _train(model: Net, zero: object, data: list, steps: range) -> tuple[list[float], list[float]]:
    rank = dist.get_rank()
    losses, norms = [], []
    for step in steps:
        x, y = data[step][rank]
        loss = _loss(model, x, y)
        loss.backward()
        zero.reducer.finish()
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
        norms.append(zero.global_grad_norm)
    return losses, norms


def _full_grads(model: Net, zero: object, x: torch.Tensor, y: torch.Tensor, ep_rank: int) -> dict:
    """The averaged gradients of one more batch, assembled from the partitions (ds_zero.debug); the vectorized
    update (an identity) assembles expert and dense parameters together, one all-reduce per process group."""
    from ds_zero.debug import safe_get_full_fp32_param, safe_get_full_grad, safe_update_full_grad_vectorized

    for p in model.parameters():
        assert torch.equal(safe_get_full_fp32_param(p), p.detach())
    _loss(model, x, y).backward()
    zero.reducer.finish()
    safe_update_full_grad_vectorized(list(model.parameters()), lambda g: g * 1.0)
    return {_global_name(n, ep_rank, model.moe.num_local_experts): safe_get_full_grad(p)
            for n, p in model.named_parameters()}


def _zero_rank(state: dict, ep_size: int, stage: int, reduce: dict) -> dict:
    model, ep_rank = _expert_model(state, ep_size)
    zero = _zero_optimizer(model, stage, **reduce)
    data = _data(STEPS + 1, dist.get_world_size())
    losses, norms = _train(model, zero, data, range(STEPS))
    comms = [(fg.layout.world_size, fg.grad_divisor) for fg in zero.groups]
    params = _global_params(model, ep_rank)
    grads = _full_grads(model, zero, *data[STEPS][dist.get_rank()], ep_rank)
    return {"losses": losses, "norms": norms, "params": params, "comms": comms, "grads": grads}


def _reference(state: dict, world: int, steps: int, micro: int = 1) -> dict:
    """ep_size=1 in one process: the gradient is the mean over every rank's (and micro batch's) loss."""
    model = Net(1)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    data = _data(steps * micro, world)
    losses, norms = [[] for _ in range(world)], []
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            for rank in range(world):
                loss = _loss(model, *data[step * micro + m][rank])
                (loss / (world * micro)).backward()
                losses[rank].append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    for x, y in _data(steps * micro + 1, world)[-1]:  # the next batch's averaged gradient
        (_loss(model, x, y) / world).backward()
    return {"losses": losses, "norms": norms, "params": params,
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def _check(got: list[dict], want: dict) -> None:
    assert max(want["norms"]) > CLIP, "clipping must really happen"
    for rank, g in enumerate(got):
        torch.testing.assert_close(g["losses"], want["losses"][rank], rtol=1e-5, atol=1e-7)
        if "norms" in g:
            torch.testing.assert_close(g["norms"], want["norms"], rtol=1e-5, atol=0)
        assert sorted(g["params"]) != [] and set(g["params"]) <= set(want["params"])
        for name, value in g["params"].items():
            torch.testing.assert_close(value, want["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        for name, value in g.get("grads", {}).items():
            torch.testing.assert_close(value, want["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    seen = {name for g in got for name in g["params"]}
    assert seen == set(want["params"]), "every global expert is held by some rank"


@pytest.mark.parametrize(("world", "stage", "reduce"), [
    (2, 1, {}), (2, 2, {}), (4, 1, {}), (4, 2, {}),
    (4, 2, {"overlap_comm": True, "bucket_numel": 150}),  # several buckets in flight, expert and dense ones
    (4, 2, {"use_multi_rank_bucket_allreduce": False, "bucket_numel": 150}),  # a reduce to each owner
    (4, 1, {"reduce_scatter": False}),  # an all-reduce per bucket
], ids=["w2-stage1", "w2-stage2", "w4-stage1", "w4-stage2", "w4-stage2-overlap", "w4-stage2-reduce",
        "w4-stage1-allreduce"])
def test_expert_parallel_zero_equals_every_expert_on_every_rank(world, stage, reduce):
    state = _initial_state()
    got = run_distributed(_zero_rank, world_size=world, args=(state, 2, stage, reduce), timeout=60)
    edp = world // 2
    assert got[0]["comms"] == [(world, float(world)), (edp, float(world))]  # dense group, expert group
    _check(got, _reference(state, world, STEPS))


def test_ep_size_one_zero1_equals_reference():
    """ep_size=1: the expert group's expert-data-parallel group is the whole data-parallel group."""
    state = _initial_state()
    got = run_distributed(_zero_rank, world_size=2, args=(state, 1, 1, {}), timeout=60)
    assert got[0]["comms"] == [(2, 2.0), (2, 2.0)]
    _check(got, _reference(state, 2, STEPS))


def _engine_rank(state: dict, stage: int) -> dict:
    import deepspeed
    from ds_moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(100 + dist.get_rank())
    model = Net(2)
    groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters()),
                                                                    "name": "dense"}])
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 2, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    ep_rank = dist.get_rank(group=model.moe.deepspeed_moe.ep_group)
    with torch.no_grad():  # this rank's experts from the global ones, whatever the engine's start-up broadcast did
        for name, p in model.named_parameters():
            p.copy_(state[_global_name(name, ep_rank, model.moe.num_local_experts)])
    engine.optimizer.sync_master_from_model()
    data = _data(2 * STEPS, dist.get_world_size())
    losses = []
    for step in range(2 * STEPS):
        loss = _loss(engine, *data[step][dist.get_rank()])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "params": _global_params(model, ep_rank)}


def test_engine_zero2_moe_groups_with_gradient_accumulation():
    state = _initial_state()
    got = run_distributed(_engine_rank, world_size=4, args=(state, 2), timeout=60)
    _check(got, _reference(state, 4, STEPS, micro=2))


def _checkpoint_rank(state: dict, stage: int, path: str) -> dict:
    data = _data(2 * STEPS, dist.get_world_size())
    model, ep_rank = _expert_model(state, 2)
    zero = _zero_optimizer(model, stage)
    _train(model, zero, data, range(STEPS))
    saved = zero.state_dict()
    file = f"{path}/rank{dist.get_rank()}.pt"
    torch.save(saved, file)
    dist.barrier()
    _train(model, zero, data, range(STEPS, 2 * STEPS))
    straight = _global_params(model, ep_rank)

    model, _ = _expert_model(state, 2)  # the initial weights: the shards restore the trained ones
    zero = _zero_optimizer(model, stage)
    zero.load_state_dict(torch.load(file, weights_only=True))
    _train(model, zero, data, range(STEPS, 2 * STEPS))
    with pytest.raises(ValueError, match="restored only onto the layout it was saved with"):
        zero.load_state_dict([torch.load(f"{path}/rank{r}.pt", weights_only=True)
                              for r in range(dist.get_world_size())])
    return {"straight": straight, "resumed": _global_params(model, ep_rank),
            "partition_count": saved["partition_count"], "paddings": saved["group_paddings"],
            "layout": [(fg.rank, fg.layout.world_size, fg.layout.padding) for fg in zero.groups]}


@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_round_trip_with_moe_groups(stage, tmp_path):
    got = run_distributed(_checkpoint_rank, world_size=4, args=(_initial_state(), stage, str(tmp_path)), timeout=60)
    for rank, g in enumerate(got):
        assert g["partition_count"] == [4, 2]
        # each group's padding is recorded by the last rank of its own process group (expert groups {0,2}, {1,3})
        assert [r for r, _, _ in g["layout"]] == [rank, rank // 2]
        assert all(pad for _, _, pad in g["layout"])
        assert g["paddings"] == [pad if r == w - 1 else 0 for r, w, pad in g["layout"]]
        for name, value in g["straight"].items():
            assert torch.equal(value, g["resumed"][name]), name


def _stage3_refusal_rank() -> str:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    try:
        deepspeed.initialize(model=Net(2), config=config)
    except AssertionError as err:  # DeepSpeed's type; ours is also a ConfigError naming the key
        from ds_config import ConfigError

        assert isinstance(err, ConfigError)
        return str(err)
    return "no error"


def test_native_moe_with_zero_stage3_is_refused_as_deepspeed_does():
    messages = run_distributed(_stage3_refusal_rank, world_size=2, timeout=60)
    for message in messages:
        assert "Native DeepSpeed MoE is not supported with ZeRO Stage 3" in message
        assert "zero_optimization.stage" in message and "accepted: 0, 1, 2" in message

"""``deepspeed.zero.TiledLinear`` (memory-centric tiling): a linear layer cut into ``out_splits x in_splits`` tile
submodules computes what the untiled ``nn.Linear`` computes (outputs and gradients, after ``copy_params_from``),
in one process and under ZeRO-3 on 2 gloo ranks, built inside ``zero.Init`` and trained through
``deepspeed.initialize``, where only one tile's weights are whole while it runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_zero.zero3.tiled_linear import TiledLinear, TiledLinearReturnBias, TilingError, partition_uniform


def _pair(in_f: int, out_f: int, bias: bool = True, **kw) -> tuple[torch.nn.Linear, TiledLinear]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_f, out_f, bias=bias)
    return linear, TiledLinear(in_f, out_f, bias=bias, init_linear=linear, **kw)


def _tile_grads(tiled: TiledLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tiles' weight (and bias) gradients reassembled into the full layer's layout."""
    rows = [torch.cat([t.weight.grad for t in row], dim=1) for row in tiled.linears]
    if not tiled.use_bias:
        return torch.cat(rows, dim=0), None
    return torch.cat(rows, dim=0), torch.cat([row[-1].bias.grad for row in tiled.linears])


@pytest.mark.parametrize(("in_f", "out_f", "in_splits", "out_splits", "bias"), [
    (12, 10, 3, 2, True), (7, 5, 3, 2, True), (7, 5, 7, 5, False), (6, 4, 1, 1, True), (9, 8, 1, 3, True),
])
def test_outputs_and_gradients_equal_the_untiled_linear(in_f, out_f, in_splits, out_splits, bias):
    linear, tiled = _pair(in_f, out_f, bias, in_splits=in_splits, out_splits=out_splits)
    assert len(tiled.linears) == out_splits and all(len(row) == in_splits for row in tiled.linears)
    # one bias per output row, on its last input tile (DeepSpeed's state-dict keys)
    bias_keys = sorted(k for k in tiled.state_dict() if k.endswith("bias"))
    assert bias_keys == ([f"linears.{o}.{in_splits - 1}.bias" for o in range(out_splits)] if bias else [])
    x = torch.randn(3, 2, in_f, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = linear(xa), tiled(xb)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    upstream = torch.randn_like(want)
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-6, atol=1e-6)
    weight_grad, bias_grad = _tile_grads(tiled)
    torch.testing.assert_close(weight_grad, linear.weight.grad, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(bias_grad, linear.bias.grad, rtol=1e-6, atol=1e-6)


def test_partition_is_deepspeeds_uniform_split():
    assert partition_uniform(7, 3) == [0, 3, 5, 7]  # the first 7 % 3 parts are one longer
    assert partition_uniform(12, 3) == [0, 4, 8, 12]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    tiled = TiledLinear(7, 5, in_splits=3, out_splits=2)
    assert [tuple(t.weight.shape) for t in tiled.linears[0]] == [(3, 3), (3, 2), (3, 2)]
    assert [tuple(row[0].weight.shape) for row in tiled.linears] == [(3, 3), (2, 3)]


def test_pre_split_input_and_uncombined_output():
    linear, tiled = _pair(7, 5, in_splits=3, out_splits=2, input_is_already_split=True, combine_out_splits=False)
    x = torch.randn(4, 7)
    outs = tiled(list(torch.split(x, [3, 2, 2], dim=-1)))
    assert isinstance(outs, list) and [tuple(o.shape) for o in outs] == [(4, 3), (4, 2)]
    torch.testing.assert_close(torch.cat(outs, dim=-1), linear(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(TilingError, match="in_splits=3 input chunks, got 2 chunks"):
        tiled(list(torch.split(x, [5, 2], dim=-1)))
    with pytest.raises(TilingError, match="in_features=7"):
        _pair(7, 5, in_splits=3)[1](torch.randn(4, 6))


class _SkipBiasLinear(torch.nn.Linear):
    """Megatron-style: returns the bias for the caller to add."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.nn.functional.linear(x, self.weight), self.bias


def test_return_bias_variant_returns_the_concatenated_bias():
    linear, tiled = _pair(6, 5, in_splits=2, out_splits=2)
    ret = TiledLinearReturnBias(6, 5, in_splits=2, out_splits=2, linear_cls=_SkipBiasLinear, init_linear=linear)
    x = torch.randn(3, 6)
    out, bias = ret(x)
    torch.testing.assert_close(bias, linear.bias)
    torch.testing.assert_close(out + bias, linear(x), rtol=1e-6, atol=1e-6)
    no_bias = TiledLinearReturnBias(6, 5, bias=False, in_splits=2, out_splits=2, linear_cls=_SkipBiasLinear)
    assert no_bias(x)[1] is None
    with pytest.raises(TilingError, match=r"must return \(output, bias\)"):
        TiledLinearReturnBias(6, 5, in_splits=2)(x)  # plain Linear tiles return one tensor


def test_linear_cls_and_kwargs_reach_every_tile():
    tiled = TiledLinear(6, 4, in_splits=2, out_splits=2, dtype=torch.float64)
    assert {t.weight.dtype for row in tiled.linears for t in row} == {torch.float64}
    assert tiled(torch.randn(2, 6, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"in_splits": 0}, r"in_splits=0 must be in the range \[1, in_features=6\]"),
    ({"in_splits": 7}, r"in_splits=7 must be in the range \[1, in_features=6\]"),
    ({"out_splits": 0}, r"out_splits=0 must be in the range \[1, out_features=4\]"),
    ({"out_splits": 5}, r"out_splits=5 must be in the range \[1, out_features=4\]"),
])
def test_bad_splits_are_named(kwargs, match):
    with pytest.raises(TilingError, match=match) as info:
        TiledLinear(6, 4, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)  # DeepSpeed: RuntimeError


def test_bad_types_and_copy_sources_are_named():
    with pytest.raises(TypeError, match="in_splits must be an int, got float"):
        TiledLinear(6, 4, in_splits=2.0)
    with pytest.raises(TilingError, match="in_features must be a positive int"):
        TiledLinear(0, 4)
    tiled = TiledLinear(6, 4, in_splits=2)
    with pytest.raises(TilingError, match=r"other.weight has shape \(6, 4\), expected"):
        tiled.copy_params_from(torch.nn.Linear(4, 6))
    with pytest.raises(TilingError, match="bias=True but other.bias is missing"):
        tiled.copy_params_from(torch.nn.Linear(6, 4, bias=False))
    with pytest.raises(TilingError, match="bias=False but other.bias is present"):
        TiledLinear(6, 4, bias=False, init_linear=torch.nn.Linear(6, 4))


def test_served_at_deepspeeds_paths():
    import deepspeed
    import deepspeed.runtime.zero.tiling as tiling

    assert deepspeed.zero.TiledLinear is tiling.TiledLinear is TiledLinear
    assert deepspeed.zero.TiledLinearReturnBias is tiling.TiledLinearReturnBias is TiledLinearReturnBias


# ---- ZeRO-3 on 2 gloo ranks ------------------------------------------------------------------------------------
IN, OUT, CLASSES = 11, 10, 3
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
      "stage3_max_reuse_distance": 0}
CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": Z3,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}


class Net(torch.nn.Module):
    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(IN, IN)  # so that the body's input requires grad, as inside a real model
        self.body = body
        self.head = torch.nn.Linear(OUT, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(torch.tanh(self.pre(x)))))


def _seeded_linear() -> torch.nn.Linear:
    torch.manual_seed(0)  # the same on every rank
    return torch.nn.Linear(IN, OUT)


def _train(engine, steps: int, watch: list | None = None) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(2 * world, 3, IN, generator=gen), torch.randint(CLASSES, (2 * world, 3), generator=gen)
        out = engine(x[2 * rank:2 * rank + 2])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, CLASSES), y[2 * rank:2 * rank + 2].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _tiled_vs_untiled_zero3() -> dict:
    import deepspeed

    torch.manual_seed(dist.get_rank())  # zero.Init and the engine broadcast rank 0's values (the head)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        tiled_net = Net(TiledLinear(IN, OUT, in_splits=3, out_splits=2, init_linear=_seeded_linear()))
    tiles = [t for row in tiled_net.body.linears for t in row]
    built = {"empty": all(p.numel() == 0 for p in tiled_net.parameters()),
             "parts": [t.weight.ds_tensor.numel() for t in tiles]}
    untiled_net = Net(_seeded_linear())
    for name in ("pre", "head"):
        getattr(untiled_net, name).load_state_dict(_whole(getattr(tiled_net, name)))
    tiled, *_ = deepspeed.initialize(model=tiled_net, config=CONFIG)
    untiled, *_ = deepspeed.initialize(model=untiled_net, config=CONFIG)

    # how many tiles' weights are whole while each tile runs; read past the ZeRO-3 parameter dict (``u.weight``
    # during a forward would gather the weight as an external parameter of the running tile)
    weights = [dict.get(t._parameters, "weight") for t in tiles]
    whole_tiles = []
    for t in tiles:
        t.register_forward_pre_hook(
            lambda *_: whole_tiles.append(("forward", sum(w.ds_status.name == "AVAILABLE" for w in weights))))
        t.register_full_backward_hook(
            lambda *_: whole_tiles.append(("backward", sum(w.ds_status.name == "AVAILABLE" for w in weights))))
    tiled_losses, untiled_losses = _train(tiled, 4), _train(untiled, 4)
    weights = _whole(tiled.module.body)
    rows = [torch.cat([weights[f"linears.{o}.{i}.weight"] for i in range(3)], dim=1) for o in range(2)]
    return {"built": built, "whole_tiles": whole_tiles, "tiled_losses": tiled_losses,
            "untiled_losses": untiled_losses, "tiled_weight": torch.cat(rows),
            "tiled_bias": torch.cat([weights[f"linears.{o}.2.bias"] for o in range(2)]),
            "untiled": _whole(untiled.module.body), "after": {p.ds_status.name for p in tiled.module.parameters()}}


def test_zero3_tiled_trains_like_the_untiled_layer_one_tile_at_a_time():
    r0, r1 = run_distributed(_tiled_vs_untiled_zero3, world_size=2, timeout=90)
    # built partitioned under zero.Init: each rank holds ceil(numel / 2) of every 5x4, 5x4, 5x3 tile
    assert r0["built"] == {"empty": True, "parts": [10, 10, 8, 10, 10, 8]}
    # one tile whole at a time in forward (prefetch off, reuse distance 0, nothing persistent); in backward a tile
    # is released as soon as its gradients have landed, before the module's full-backward hook runs
    one_at_a_time = ([("forward", 1)] * 6 + [("backward", 0)] * 6) * 4
    assert r0["whole_tiles"] == one_at_a_time and r1["whole_tiles"] == one_at_a_time
    assert r0["after"] == {"NOT_AVAILABLE"}
    assert r0["tiled_losses"] == pytest.approx(r0["untiled_losses"], rel=1e-5)
    assert r1["tiled_losses"] == pytest.approx(r1["untiled_losses"], rel=1e-5)
    torch.testing.assert_close(r0["tiled_weight"], r0["untiled"]["weight"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r0["tiled_bias"], r0["untiled"]["bias"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r1["tiled_weight"], r0["tiled_weight"], rtol=0, atol=0)
    # training moved the weights away from the shared start
    assert not torch.allclose(r0["tiled_weight"], _seeded_linear().weight, atol=1e-4)

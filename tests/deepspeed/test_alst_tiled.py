"""ALST tiled compute (deepspeed.runtime.sequence_parallel.ulysses_sp): TiledMLP, sequence_tiled_compute,
TiledFusedLogitsLoss against the untiled computation.

Tolerance (fp32): rtol=1e-5, atol=1e-6 everywhere. Outputs and input gradients are per-row computations, but a
matmul over fewer rows may take another BLAS blocking (observed: one ulp off at 29 rows in 4 tiles), and parameter
gradients are sums over tiles (another order of additions). A single tile is compared bitwise.
"""

from __future__ import annotations

import pytest
import torch
from _harness import distributed_test

from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledLoss,
    TiledMLP,
    sequence_tiled_compute,
)

PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}


class _MLP(torch.nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _mlp_fn(module: _MLP, x: torch.Tensor) -> torch.Tensor:
    return _MLP.forward(module, x)


def _reference(module: torch.nn.Module, x: torch.Tensor, run) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(output, x.grad, parameter grads) of ``run(x)`` backpropagated with a fixed random upstream gradient."""
    module.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_(True)
    out = run(leaf)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(upstream)
    return out.detach(), leaf.grad, [p.grad.clone() for p in module.parameters()]


def _assert_same(ref: tuple, got: tuple, bitwise: bool = False) -> None:
    for a, b in zip((ref[0], ref[1], *ref[2]), (got[0], got[1], *got[2]), strict=True):
        if bitwise:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, **PARAM_TOL)


@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("shards", [1, 4, 7, 50])  # 50 > seqlen: tiles of one row
def test_tiled_mlp_equals_untiled(bs: int, shards: int) -> None:
    torch.manual_seed(0)
    mlp = _MLP()
    x = torch.randn(bs, 29, 16)
    ref = _reference(mlp, x, mlp)
    got = _reference(mlp, x, lambda t: TiledMLP.apply(_mlp_fn, mlp, t, shards, list(mlp.parameters())))
    _assert_same(ref, got, bitwise=shards == 1)


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
@pytest.mark.parametrize("bs", [1, 2])
def test_sequence_tiled_compute_equals_untiled(reduction: str | None, bs: int) -> None:
    torch.manual_seed(1)
    mlp = _MLP()
    x = torch.randn(bs, 30, 16)
    scale = torch.linspace(0.5, 1.5, 30).view(1, 30, 1).expand(bs, 30, 1).contiguous()  # a second sharded input

    def fn(x: torch.Tensor, scale: torch.Tensor, module: _MLP) -> torch.Tensor:
        return module(x) * scale

    def untiled(t: torch.Tensor) -> torch.Tensor:
        out = fn(t, scale, mlp)
        return out if reduction is None else (out.mean() if reduction == "mean" else out.sum())

    def tiled(t: torch.Tensor) -> torch.Tensor:
        return sequence_tiled_compute(fn, 30, 4, {"x": t, "scale": scale}, {"module": mlp}, "x",
                                      list(mlp.parameters()), output_unshard_dimension=1, output_reduction=reduction)

    _assert_same(_reference(mlp, x, untiled), _reference(mlp, x, tiled))


def test_sequence_tiled_compute_per_tile_losses() -> None:
    """output_unshard_dimension=0: one scalar per tile, stacked; the mean of tile sums over equal tiles."""
    torch.manual_seed(2)
    mlp = _MLP()
    x = torch.randn(2, 24, 16)

    def fn(x: torch.Tensor, module: _MLP) -> torch.Tensor:
        return module(x).pow(2).sum()

    ref = _reference(mlp, x, lambda t: fn(t, mlp) / 4)
    got = _reference(mlp, x, lambda t: sequence_tiled_compute(fn, 24, 4, {"x": t}, {"module": mlp}, "x",
                                                              list(mlp.parameters()), 0, "mean"))
    torch.testing.assert_close(got[0], ref[0], **PARAM_TOL)  # a sum of 4 partial sums: reordered additions
    torch.testing.assert_close(got[1], ref[1], **PARAM_TOL)
    for a, b in zip(ref[2], got[2], strict=True):
        torch.testing.assert_close(b, a, **PARAM_TOL)


def _logits_setup(seed: int = 3) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    head = torch.nn.Linear(16, 40)
    x = torch.randn(2, 30, 16)
    y = torch.randint(0, 40, (2, 30))
    y[0, :5] = -100  # ignored targets
    return head, x, y


def _ce_sum(head: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(head(x).reshape(-1, 40), y.reshape(-1), reduction="sum")


@pytest.mark.parametrize("upstream", [1.0, 0.25, 1024.0])  # 1/gradient_accumulation_steps, an fp16 loss scale
def test_tiled_fused_logits_loss_sum_any_upstream_gradient(upstream: float) -> None:
    head, x, y = _logits_setup()

    def loss_of(run):
        head.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_(True)
        loss = run(leaf)
        (loss * upstream).backward()
        return loss.detach(), leaf.grad, [p.grad.clone() for p in head.parameters()]

    ref = loss_of(lambda t: _ce_sum(head, t, y))
    got = loss_of(lambda t: TiledFusedLogitsLoss.apply(_ce_sum, head, t, y, None, 4, list(head.parameters()), "sum"))
    for a, b in zip((ref[0], ref[1], *ref[2]), (got[0], got[1], *got[2]), strict=True):
        torch.testing.assert_close(b, a, **PARAM_TOL)


def test_tiled_fused_logits_loss_mean_and_mask() -> None:
    """'mean' is the mean of per-tile losses (equal tiles here), and the mask is tiled with x and y."""
    head, x, y = _logits_setup(4)
    mask = (torch.arange(30) % 3 != 0).expand(2, 30).contiguous()

    def masked_mean(head: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        per = torch.nn.functional.cross_entropy(head(x).reshape(-1, 40), y.reshape(-1), reduction="none",
                                                ignore_index=-100)
        return (per * mask.reshape(-1)).sum() / 20  # every 15-row tile of this mask holds 10 counted rows

    leaf = x.clone().requires_grad_(True)
    tiles = [masked_mean(head, leaf.reshape(60, 16)[i:i + 15], y.reshape(60)[i:i + 15], mask.reshape(60)[i:i + 15])
             for i in range(0, 60, 15)]
    ref = torch.stack(tiles).mean()
    ref.backward()
    ref_x, ref_w = leaf.grad, head.weight.grad.clone()
    head.zero_grad(set_to_none=True)
    leaf2 = x.clone().requires_grad_(True)
    got = TiledFusedLogitsLoss.apply(masked_mean, head, leaf2, y, mask, 4, [head.weight, head.bias], "mean")
    got.backward()
    torch.testing.assert_close(got, ref, **PARAM_TOL)
    torch.testing.assert_close(leaf2.grad, ref_x, **PARAM_TOL)
    torch.testing.assert_close(head.weight.grad, ref_w, **PARAM_TOL)


def test_grad_ready_flag_marks_only_the_last_tile() -> None:
    """ZeRO's protocol: a parameter's gradient is final (ds_grad_is_ready True) only when its last tile lands."""
    torch.manual_seed(5)
    mlp = _MLP()
    seen: list[bool] = []
    mlp.up.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.ds_grad_is_ready))
    x = torch.randn(1, 20, 16, requires_grad=True)
    TiledMLP.apply(_mlp_fn, mlp, x, 5, list(mlp.parameters())).sum().backward()
    assert seen == [False, False, False, False, True]


def test_errors_name_the_argument() -> None:
    mlp = _MLP()
    x = torch.randn(1, 8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="shards must be a positive integer, got 0"):
        TiledMLP.apply(_mlp_fn, mlp, x, 0, None)
    with pytest.raises(ValueError, match="grad_requiring_tensor_key='y'"):
        sequence_tiled_compute(lambda x: x, 8, 2, {"x": x}, {}, "y")
    with pytest.raises(ValueError, match="output_reduction must be None, 'mean' or 'sum', got 'max'"):
        sequence_tiled_compute(lambda x: x, 8, 2, {"x": x}, {}, "x", output_reduction="max")
    with pytest.raises(ValueError, match=r"kwargs_to_shard\['x'\] must be a \[bs, seqlen=9"):
        sequence_tiled_compute(lambda x: x, 9, 2, {"x": x}, {}, "x")
    head, hx, y = _logits_setup()
    with pytest.raises(ValueError, match="output_reduction must be 'mean' or 'sum', got None"):
        TiledFusedLogitsLoss.apply(_ce_sum, head, hx, y, None, 2, None, None)
    with pytest.raises(ValueError, match=r"mask must be \[batch_size, seq_len\] = \(2, 30\)"):
        TiledFusedLogitsLoss.apply(_ce_sum, head, hx, y, torch.ones(2, 29), 2, None, "sum")


class _Model(torch.nn.Module):
    def __init__(self, tiled: bool) -> None:
        super().__init__()
        self.mlp = _MLP()
        self.head = torch.nn.Linear(16, 40, bias=False)
        self.tiled = tiled

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.tiled:
            return _ce_sum(self.head, self.mlp(x), y)
        h = TiledMLP.apply(_mlp_fn, self.mlp, x, 3, list(self.mlp.parameters()))
        return TiledFusedLogitsLoss.apply(_ce_sum, self.head, h, y, None, 3, [self.head.weight], "sum")


@distributed_test(world_size=[2])
@pytest.mark.parametrize("stage", [2, 3])
def test_engine_gradients_equal_untiled(stage: int) -> None:
    """Through deepspeed.initialize with ZeRO on 2 ranks (gradient accumulation 2, so the upstream gradient is
    1/2): the reduced gradients of the tiled model equal the untiled model's."""
    import torch.distributed as dist

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    torch.manual_seed(11 + dist.get_rank())
    x, y = torch.randn(2, 12, 16), torch.randint(0, 40, (2, 12))
    grads = []
    for tiled in (False, True):
        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=_Model(tiled), config=config)
        engine.backward(engine(x, y))
        grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], **PARAM_TOL, msg=name)


def _hf_style_loss(logits: torch.Tensor, labels: None, vocab_size: int, shift_labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size).float(), shift_labels.reshape(-1),
                                             ignore_index=-100)


@pytest.mark.parametrize("upstream", [1.0, 0.5])
def test_tiled_loss_equals_untiled_mean(upstream: float) -> None:
    """Tiles hold different numbers of counted targets (one none at all): the token-weighted mean is the untiled
    mean, in value and gradient."""
    torch.manual_seed(6)
    logits = torch.randn(2, 24, 40)
    labels = torch.randint(0, 40, (2, 24))
    labels[:, 6:12] = -100  # tile 2 of 4 counts nothing
    labels[0, 0:3] = -100   # tile 1 counts fewer than the others
    runs = []
    for tiled in (False, True):
        leaf = logits.clone().requires_grad_(True)
        loss = (TiledLoss.apply(_hf_style_loss, leaf, 40, labels, 4) if tiled
                else _hf_style_loss(leaf, None, 40, labels))
        (loss * upstream).backward()
        runs.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(runs[1][0], runs[0][0], **PARAM_TOL)
    torch.testing.assert_close(runs[1][1], runs[0][1], **PARAM_TOL)


def test_tiled_loss_with_nothing_counted_is_zero() -> None:
    leaf = torch.randn(1, 8, 40, requires_grad=True)
    loss = TiledLoss.apply(_hf_style_loss, leaf, 40, torch.full((1, 8), -100), 2)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(leaf.grad) == 0

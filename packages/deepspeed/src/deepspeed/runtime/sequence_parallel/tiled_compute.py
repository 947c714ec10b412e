"""ALST's tiled compute: run a sequence-wise computation a tile of the sequence at a time.

A position-wise block (an MLP, the LM head plus its loss) on a very long sequence materializes activations that
grow with the sequence (the MLP's intermediate, the ``[s, vocab]`` logits). These autograd functions keep only one
tile's activations alive: the forward runs each tile without a graph, and the backward recomputes one tile at a
time with a graph, backpropagates it and frees it. The price is one extra forward of the block.

Parameter gradients therefore land once per tile. ``compute_params`` names the parameters the block uses: each
gets ``param.ds_grad_is_ready = False`` while a tile that is not the last is backpropagated, and ``True`` for the
last, so the engine's gradient hooks hand a parameter's gradient to ZeRO once, as the sum over tiles (DeepSpeed's
protocol). Without DeepSpeed ``compute_params`` may be None.

Every tile's output is the untiled computation's rows (same operations on fewer rows), so outputs match the untiled
run; parameter gradients are sums over tiles, equal up to the order of the additions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledLoss", "TiledMLP", "sequence_tiled_compute"]

_REDUCTIONS = (None, "mean", "sum")


def _check_shards(shards: Any, who: str) -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"{who}: shards must be a positive integer, got {shards!r}")
    return shards


def _ready_params(compute_params: Iterable[Tensor] | None, module: Any = None) -> list[Tensor]:
    """The trainable ``compute_params``, plus ``module``'s own when it is a Module (deduplicated, in order)."""
    found: dict[int, Tensor] = {}
    owned = module.parameters() if isinstance(module, torch.nn.Module) else ()
    for p in (*(compute_params or ()), *owned):
        if p.requires_grad:
            found.setdefault(id(p), p)
    return list(found.values())


def _anchor(params: list[Tensor]) -> Tensor:
    """A throwaway leaf input that makes the node's output need a backward when any parameter trains (the
    parameters themselves are not inputs: their gradients land through the recompute, and an input edge would
    fire their post-accumulate hooks once more with no gradient)."""
    return torch.empty(0, requires_grad=bool(params))


def _mark(params: list[Tensor], last: bool) -> None:
    for p in params:
        p.ds_grad_is_ready = last


def _leaf(t: Tensor, requires_grad: bool) -> Tensor:
    """A fresh graph leaf holding ``t``'s values (the recompute's input)."""
    return t.detach().requires_grad_(requires_grad)


def _tile_bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each tile: ``ceil(length / shards)`` long, the last one shorter (as torch.chunk)."""
    step = max(1, math.ceil(length / shards))
    return [(s, min(step, length - s)) for s in range(0, length, step)]


class TiledMLP(torch.autograd.Function):
    """``fn(module, x)`` over ``x: [..., seq, hidden]`` in ``shards`` tiles of the sequence (dim -2).

    ``TiledMLP.apply(fn, module, x, shards, compute_params)``; the output equals ``fn(module, x)``. The backward
    recomputes each tile on the flattened rows of ``x`` (``[-1, hidden]``), so a batch of several sequences tiles
    the same way as one long one. When any parameter (``compute_params`` and ``module``'s own) trains, the
    output needs a backward even if ``x`` needs no gradient; parameter gradients land through the recompute.
    """

    @classmethod
    def apply(cls, fn: Callable, module: Any, x: Tensor, shards: int,  # type: ignore[override]
              compute_params: Iterable[Tensor] | None = None) -> Tensor:
        params = _ready_params(compute_params, module)
        return super().apply(fn, module, x, shards, params, _anchor(params))

    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, x: Tensor, shards: int, params: list[Tensor],
                _anchor: Tensor) -> Tensor:
        _check_shards(shards, "TiledMLP")
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [..., seq, hidden], got shape {tuple(x.shape)}")
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.params = params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, t) for t in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden)
        grads = grad_out.reshape(-1, grad_out.shape[-1])
        x_grad = torch.zeros_like(rows) if ctx.needs_input_grad[2] else None
        bounds = _tile_bounds(rows.shape[0], ctx.shards)

        for i, (start, length) in enumerate(bounds):
            _mark(ctx.params, last=i + 1 == len(bounds))
            leaf = _leaf(rows.narrow(0, start, length), x_grad is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, leaf)
            if out.requires_grad:
                torch.autograd.backward(out, grads.narrow(0, start, length).reshape(out.shape))
            if x_grad is not None and leaf.grad is not None:
                x_grad.narrow(0, start, length).copy_(leaf.grad)
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None, None


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict[str, Tensor],
                           kwargs_to_pass: dict[str, Any], grad_requiring_tensor_key: str,
                           compute_params: Iterable[Tensor] | None = None, output_unshard_dimension: int = 1,
                           output_reduction: str | None = "mean") -> Tensor:
    """``fn(**kwargs_to_shard, **kwargs_to_pass)`` with every ``kwargs_to_shard`` tensor (``[bs, seqlen, ...]``)
    tiled on dim 1 into ``shards`` tiles.

    The tiles' outputs are concatenated on ``output_unshard_dimension`` (0: stacked, for a per-tile scalar such as
    a loss), then reduced by ``output_reduction`` (None, "mean" or "sum"). Only
    ``kwargs_to_shard[grad_requiring_tensor_key]`` gets an input gradient; parameters get theirs as usual.
    """
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"sequence_tiled_compute: grad_requiring_tensor_key={grad_requiring_tensor_key!r} must be "
                         f"a key of kwargs_to_shard, which has {sorted(kwargs_to_shard)}")
    if output_reduction not in _REDUCTIONS:
        raise ValueError(f"sequence_tiled_compute: output_reduction must be None, 'mean' or 'sum', "
                         f"got {output_reduction!r}")
    for k, v in kwargs_to_shard.items():
        if not torch.is_tensor(v) or v.dim() < 2 or v.shape[1] != seqlen:
            shape = tuple(v.shape) if torch.is_tensor(v) else type(v).__name__
            raise ValueError(f"sequence_tiled_compute: kwargs_to_shard[{k!r}] must be a [bs, seqlen={seqlen}, ...] "
                             f"tensor, got {shape}")
    keys = (list(kwargs_to_shard), list(kwargs_to_pass))
    return SequenceTiledCompute.apply(fn, seqlen, shards, keys[0], keys[1], grad_requiring_tensor_key,
                                      compute_params, output_unshard_dimension, output_reduction,
                                      *kwargs_to_shard.values(), *kwargs_to_pass.values())


def _reduce(out: Tensor, reduction: str | None) -> Tensor:
    if reduction is None:
        return out
    return out.mean() if reduction == "mean" else out.sum()


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind ``sequence_tiled_compute`` (positional arguments, as DeepSpeed's):
    ``apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
    output_unshard_dimension, output_reduction, *values_to_shard, *values_to_pass)``. As in TiledMLP, the
    output needs a backward when ``compute_params`` or a Module in ``values_to_pass`` has a trainable parameter."""

    @classmethod
    def apply(cls, fn: Callable, seqlen: int, shards: int, keys_to_shard: list[str],  # type: ignore[override]
              keys_to_pass: list[str], grad_key: str, compute_params: Iterable[Tensor] | None, out_dim: int,
              reduction: str | None, *values: Any) -> Tensor:
        params = _ready_params(compute_params)
        for v in values:
            params += [p for p in _ready_params(None, v) if all(p is not q for q in params)]
        return super().apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_key, params, out_dim, reduction,
                             *values, _anchor(params))

    @staticmethod
    def forward(ctx: Any, fn: Callable, seqlen: int, shards: int, keys_to_shard: list[str], keys_to_pass: list[str],
                grad_key: str, params: list[Tensor], out_dim: int, reduction: str | None,
                *values_and_anchor: Any) -> Tensor:
        _check_shards(shards, "SequenceTiledCompute")
        if reduction not in _REDUCTIONS:
            raise ValueError(f"SequenceTiledCompute: output_reduction must be None, 'mean' or 'sum', got {reduction!r}")
        n = len(keys_to_shard)
        values = values_and_anchor[:-1]  # the last is the anchor
        ctx.fn, ctx.out_dim, ctx.reduction = fn, out_dim, reduction
        ctx.to_shard = dict(zip(keys_to_shard, values[:n], strict=True))
        ctx.to_pass = dict(zip(keys_to_pass, values[n:], strict=True))
        ctx.grad_key, ctx.n_inputs = grad_key, len(values_and_anchor)
        ctx.grad_index = list(ctx.to_shard).index(grad_key)
        ctx.params = params
        ctx.bounds = _tile_bounds(seqlen, shards)
        with torch.no_grad():
            outs = [fn(**_tile(ctx, i), **ctx.to_pass) for i in range(len(ctx.bounds))]
        ctx.out_lengths = [o.shape[out_dim] if out_dim != 0 else 1 for o in outs]
        full = torch.stack(outs) if out_dim == 0 else torch.cat(outs, dim=out_dim)
        ctx.out_shape = full.shape
        return _reduce(full, reduction)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        # the gradient of the reduction, spread over the unreduced output, then cut per tile
        if ctx.reduction == "mean":
            grad_full = (grad_out / math.prod(ctx.out_shape)).expand(ctx.out_shape)
        elif ctx.reduction == "sum":
            grad_full = grad_out.expand(ctx.out_shape)
        else:
            grad_full = grad_out
        target = ctx.to_shard[ctx.grad_key]
        wants_grad = ctx.needs_input_grad[9 + ctx.grad_index]
        target_grad = torch.zeros_like(target) if wants_grad else None
        offsets = [sum(ctx.out_lengths[:i]) for i in range(len(ctx.bounds))]
        for i, (start, length) in enumerate(ctx.bounds):
            _mark(ctx.params, last=i + 1 == len(ctx.bounds))
            kwargs = _tile(ctx, i)
            leaf = _leaf(kwargs[ctx.grad_key], wants_grad)
            kwargs[ctx.grad_key] = leaf
            with torch.enable_grad():
                out = ctx.fn(**kwargs, **ctx.to_pass)
            grad = grad_full[i] if ctx.out_dim == 0 else grad_full.narrow(ctx.out_dim, offsets[i], ctx.out_lengths[i])
            if out.requires_grad:
                torch.autograd.backward(out, grad.reshape(out.shape))
            if target_grad is not None and leaf.grad is not None:
                target_grad.narrow(1, start, length).copy_(leaf.grad)
        values_grads: list[Any] = [None] * ctx.n_inputs
        values_grads[ctx.grad_index] = target_grad
        return (None,) * 9 + tuple(values_grads)


def _tile(ctx: Any, i: int) -> dict[str, Tensor]:
    start, length = ctx.bounds[i]
    return {k: v.narrow(1, start, length) for k, v in ctx.to_shard.items()}


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss over logits that are never materialized whole: ``fn(module, x, y[, mask])`` per tile of the flattened
    ``[bs * seq]`` rows of ``x`` (hidden states, ``[bs, seq, ...]``), ``y`` (targets) and ``mask`` (optional,
    ``[bs, seq]``), then the mean or sum of the tiles' losses.

    ``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)``. With "mean"
    the result is the mean of per-tile losses: equal to the untiled mean loss when every tile holds the same number
    of counted targets; otherwise use "sum" of per-tile sums and divide by the count yourself (as DeepSpeed says).
    The backward recomputes one tile's logits at a time, so it is exact for any upstream gradient (a loss scale,
    1/gradient_accumulation_steps). DeepSpeed instead backpropagates inside the forward, which skips that
    recompute but gives the parameters the gradient of an upstream 1 whatever the real one is.
    """

    @classmethod
    def apply(cls, fn: Callable, module: Any, x: Tensor, y: Tensor, mask: Tensor | None,  # type: ignore[override]
              shards: int, compute_params: Iterable[Tensor] | None, output_reduction: str) -> Tensor:
        params = _ready_params(compute_params, module)
        return super().apply(fn, module, x, y, mask, shards, params, output_reduction, _anchor(params))

    @staticmethod
    def forward(ctx: Any, fn: Callable, module: Any, x: Tensor, y: Tensor, mask: Tensor | None, shards: int,
                params: list[Tensor], output_reduction: str, _anchor: Tensor) -> Tensor:
        _check_shards(shards, "TiledFusedLogitsLoss")
        _check_loss_inputs(x, y, mask, output_reduction)
        bs, seq = x.shape[:2]
        rows = (x.reshape(bs * seq, *x.shape[2:]), y.reshape(bs * seq, *y.shape[2:]),
                None if mask is None else mask.reshape(-1))
        ctx.fn, ctx.module, ctx.reduction = fn, module, output_reduction
        ctx.params = params
        ctx.bounds = _tile_bounds(bs * seq, shards)
        ctx.rows, ctx.x_shape = rows, x.shape
        with torch.no_grad():
            losses = torch.stack([fn(*_loss_args(module, rows, b)).reshape(()) for b in ctx.bounds])
        return losses.mean() if output_reduction == "mean" else losses.sum()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        x_rows = ctx.rows[0]
        wants_grad = ctx.needs_input_grad[2]
        x_grad = torch.zeros_like(x_rows) if wants_grad else None
        per_tile = grad_out / len(ctx.bounds) if ctx.reduction == "mean" else grad_out
        for i, (start, length) in enumerate(ctx.bounds):
            _mark(ctx.params, last=i + 1 == len(ctx.bounds))
            leaf = _leaf(x_rows.narrow(0, start, length), wants_grad)
            args = list(_loss_args(ctx.module, ctx.rows, (start, length)))
            args[1] = leaf
            with torch.enable_grad():
                loss = ctx.fn(*args).reshape(())
            if loss.requires_grad:
                torch.autograd.backward(loss, per_tile.to(loss.dtype))
            if x_grad is not None and leaf.grad is not None:
                x_grad.narrow(0, start, length).copy_(leaf.grad)
        x_grad = None if x_grad is None else x_grad.view(ctx.x_shape)
        return None, None, x_grad, None, None, None, None, None, None


def _check_loss_inputs(x: Tensor, y: Tensor, mask: Tensor | None, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', got {reduction!r}")
    if x.dim() < 2 or y.dim() < 2:
        raise ValueError(f"TiledFusedLogitsLoss: x and y must be at least [batch_size, seq_len], got x "
                         f"{tuple(x.shape)} and y {tuple(y.shape)}")
    if x.shape[:2] != y.shape[:2]:
        raise ValueError(f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y {tuple(y.shape)} must agree on "
                         f"[batch_size, seq_len]")
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"TiledFusedLogitsLoss: mask must be [batch_size, seq_len] = {tuple(x.shape[:2])}, got "
                         f"{tuple(mask.shape)}")


def _loss_args(module: Any, rows: tuple[Tensor, Tensor, Tensor | None], bounds: tuple[int, int]) -> tuple[Any, ...]:
    start, length = bounds
    x, y, mask = (None if t is None else t.narrow(0, start, length) for t in rows)
    return (module, x, y) if mask is None else (module, x, y, mask)


class TiledLoss(torch.autograd.Function):
    """A Transformers-style mean loss over existing ``logits`` (``[bs, seq, vocab]``) computed ``shards`` tiles of the
    sequence at a time, so the loss's float32 upcast and softmax exist for one tile only.

    ``TiledLoss.apply(loss_fn, logits, vocab_size, shift_labels, shards)`` where ``loss_fn(logits=, labels=None,
    vocab_size=, shift_labels=)`` is a model's ``loss_function`` (a mean over targets that are not -100). Tiles are
    weighted by their counted targets, so the result equals the untiled mean; tiles with none are skipped, and with no
    counted target at all the loss is 0 (with a zero gradient). DeepSpeed's backward divides by the number of tiles
    instead, which disagrees with its own token-weighted forward when tiles hold different counts.
    """

    @staticmethod
    def forward(ctx: Any, loss_fn: Callable, logits: Tensor, vocab_size: int, shift_labels: Tensor,
                shards: int) -> Tensor:
        _check_shards(shards, "TiledLoss")
        if logits.shape[:2] != shift_labels.shape[:2]:
            raise ValueError(f"TiledLoss: logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} "
                             f"must agree on [batch_size, seq_len]")
        bounds = _tile_bounds(logits.shape[1], shards)
        counts = [int((shift_labels.narrow(1, s, n) != -100).sum()) for s, n in bounds]
        ctx.loss_fn, ctx.vocab_size, ctx.bounds, ctx.counts = loss_fn, vocab_size, bounds, counts
        ctx.save_for_backward(logits, shift_labels)
        total = sum(counts)
        loss = torch.zeros((), dtype=torch.float32, device=logits.device)
        with torch.no_grad():
            for (start, length), count in zip(bounds, counts, strict=True):
                if count:
                    part = loss_fn(logits=logits.narrow(1, start, length), labels=None, vocab_size=vocab_size,
                                   shift_labels=shift_labels.narrow(1, start, length))
                    loss = loss + part.float() * (count / total)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        logits, shift_labels = ctx.saved_tensors
        logits_grad = torch.zeros_like(logits)
        total = sum(ctx.counts)
        for (start, length), count in zip(ctx.bounds, ctx.counts, strict=True):
            if not count:
                continue
            leaf = _leaf(logits.narrow(1, start, length), True)
            with torch.enable_grad():
                part = ctx.loss_fn(logits=leaf, labels=None, vocab_size=ctx.vocab_size,
                                   shift_labels=shift_labels.narrow(1, start, length))
            torch.autograd.backward(part, (grad_out * (count / total)).to(part.dtype))
            logits_grad.narrow(1, start, length).copy_(leaf.grad)
        return None, logits_grad, None, None, None

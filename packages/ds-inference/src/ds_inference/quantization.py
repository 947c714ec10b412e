"""Weight-only integer quantization of Linear and Embedding weights, dequantized on the fly (``dtype=torch.int8``).

A weight matrix is flattened and cut into ``q_groups`` equal groups; each group gets its own scale (and, for
``q_type="asymmetric"``, its own zero point). Values are stored as ``int8`` whatever ``num_bits`` (<= 8) is, so
memory is 1 byte per weight element plus 4 bytes per group. The module keeps its class; its ``weight`` reads
``None`` between calls. A plain ``nn.Linear`` or HF ``Conv1D`` gets an instance ``forward`` that runs
:func:`quantized_matmul` (tile by tile, scales folded onto the input or output; the whole float weight never
exists); :func:`quantized_matmul_reference` is its plain counterpart. Other layers keep their ``forward``: a
pre-forward hook rebuilds the weight just before the module runs (a Linear: the whole matrix in the activation
dtype; an Embedding: only the rows looked up, in the original dtype) and a forward hook drops it. Covered:
``nn.Linear``, Hugging Face's ``Conv1D`` (GPT-2), ``nn.Embedding`` and AutoTP's sharded replacements of all
three. A weight tied between modules (embedding and lm_head) is quantized once and its int8 buffers are shared.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ds_inference.autotp import EmbeddingLayer, HiddenParallelEmbedding, LinearAllreduce, LinearLayer

__all__ = [
    "QuantizedWeight",
    "dequantize",
    "dequantize_rows",
    "is_quantized",
    "model_bytes",
    "quantize",
    "quantize_weights",
    "quantized_matmul",
    "quantized_matmul_reference",
]


@dataclass
class QuantizedWeight:
    """Integer codes and per-group parameters of one weight: ``w ~= (q - zero) * scale`` group by group."""

    q: torch.Tensor  # int8, the weight's shape
    scale: torch.Tensor  # float32 [groups, 1]
    zero: torch.Tensor | None  # float32 [groups, 1] for asymmetric, None for symmetric


def _check_groups(shape: torch.Size, groups: int) -> None:
    if groups < 1 or shape.numel() % groups:
        raise ValueError(f"quant.weight.q_groups={groups} must divide the weight's {shape.numel()} elements "
                         f"(shape {tuple(shape)}); pick a divisor such as 1 or the row count")


def _grouped(weight: torch.Tensor, groups: int) -> torch.Tensor:
    _check_groups(weight.shape, groups)
    return weight.detach().float().reshape(groups, -1)


def quantize(weight: torch.Tensor, num_bits: int = 8, groups: int = 1, q_type: str = "symmetric") -> QuantizedWeight:
    """Quantize ``weight`` to ``num_bits`` (2..8) with ``groups`` scales.

    Symmetric: ``scale = max|w| / (2**(bits-1) - 1)``, codes in ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``;
    the rounding error is at most ``scale / 2`` per element. Asymmetric: ``scale = (max - min) / (2**bits - 1)``
    and a per-group zero point, codes in ``[-2**(bits-1), 2**(bits-1) - 1]``.
    """
    if not 2 <= num_bits <= 8:
        raise ValueError(f"quant.weight.num_bits={num_bits} is not supported; accepted: 2..8 (stored as int8)")
    flat = _grouped(weight, groups)
    if q_type == "symmetric":
        qmax = 2 ** (num_bits - 1) - 1
        scale = flat.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / qmax
        q = torch.round(flat / scale).clamp_(-qmax, qmax)
        zero = None
    elif q_type == "asymmetric":
        low, high = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
        scale = ((high - low) / (2**num_bits - 1)).clamp_min(torch.finfo(torch.float32).tiny)
        zero = -(2 ** (num_bits - 1)) - torch.round(low / scale)
        q = torch.round(flat / scale + zero).clamp_(-(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1)
    else:
        raise ValueError(f"quant.weight.q_type={q_type!r} is not supported; accepted: 'symmetric', 'asymmetric'")
    return QuantizedWeight(q.to(torch.int8).reshape(weight.shape), scale, zero)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``qw`` stands for, in ``dtype``."""
    groups = qw.scale.shape[0]
    codes = qw.q.reshape(groups, -1).to(qw.scale.dtype)
    if qw.zero is not None:
        codes = codes - qw.zero
    return (codes * qw.scale).reshape(qw.q.shape).to(dtype)


def dequantize_rows(qw: QuantizedWeight, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dequantize(qw, dtype)[rows]`` without building the whole matrix (an embedding lookup)."""
    width = qw.q.shape[1]
    group_size = qw.q.numel() // qw.scale.shape[0]
    # the group of every element read: groups cut the flattened matrix, so they need not align with rows
    group = (rows[:, None] * width + torch.arange(width, device=rows.device)) // group_size
    codes = qw.q[rows].to(qw.scale.dtype)
    if qw.zero is not None:
        codes = codes - qw.zero.view(-1)[group]
    return (codes * qw.scale.view(-1)[group]).to(dtype)


# weight elements per dequantized tile (1 MiB in fp32): the tile is still in cache when its matmul reads it
TILE_ELEMENTS = 1 << 18


@functools.lru_cache(maxsize=256)
def _tile_rows(width: int, span: int, tile_elements: int) -> int:
    """Rows per tile: about ``tile_elements`` elements, and a tile never splits a group of ``span`` rows unless
    it lies inside one (then it divides the group), so each tile takes its scales as a plain slice."""
    target = max(1, tile_elements // width)
    if span <= target:
        return target // span * span
    return max(d for d in range(1, target + 1) if span % d == 0)


def _tile_product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  transposed: bool) -> torch.Tensor:
    """One tile's share of the product: ``x @ tile.T`` (or ``x @ tile``, ``x`` then the tile's input slice).

    ``scale``/``zero``: ``[n_groups]`` for groups of whole rows (their rows split the tile evenly): the scales
    move off the weight onto ``x`` (rows are input features) or the output (rows are output features), so the
    tile only needs an int8 -> float cast, no broadcast multiply, and a zero point becomes the rank-1
    correction ``s * z * sum(x)``. ``[rows, pieces, 1]`` for several groups per row: the tile is dequantized
    as in :func:`dequantize`."""
    rows, batch = codes.shape[0], x.shape[0]
    if scale.dim() == 3:
        codes = codes.view(rows, scale.shape[1], -1)
        tile = ((codes - zero if zero is not None else codes) * scale).view(rows, -1).to(x.dtype)
        return x @ tile if transposed else x @ tile.t()
    weight, groups = codes.to(x.dtype), scale.shape[0]
    scale = scale.to(x.dtype).view(1, groups, 1)
    if transposed:
        x = (x.view(batch, groups, -1) * scale).view(batch, rows)
        out = x @ weight
        if zero is not None:  # sum over the group's inputs of x * s, times the group's zero point
            out -= (x.view(batch, groups, -1).sum(-1) @ zero.to(x.dtype).view(groups)).unsqueeze(-1)
        return out
    out = x @ weight.t()
    out.view(batch, groups, -1).mul_(scale)
    if zero is not None:
        out.view(batch, groups, -1).sub_(x.sum(-1).view(batch, 1, 1) * (scale * zero.to(x.dtype).view(1, groups, 1)))
    return out


def quantized_matmul(x: torch.Tensor, qw: QuantizedWeight, transposed: bool = False) -> torch.Tensor:
    """``x @ W.T`` (``transposed``: ``x @ W``, HF Conv1D's ``[in, out]`` layout) for ``W = dequantize(qw)``,
    working through tiles of about ``TILE_ELEMENTS`` elements instead of dequantizing the whole matrix.

    The fast path of int8 inference (see :func:`_tile_product`); equal to :func:`quantized_matmul_reference`
    up to float rounding. Groups that straddle rows unevenly fall back to the reference.
    """
    rows, width = qw.q.shape
    groups = qw.scale.shape[0]
    group_size = qw.q.numel() // groups
    if group_size % width == 0:  # groups of whole rows
        span = group_size // width
        step = _tile_rows(width, span, TILE_ELEMENTS)
        scale, zero = qw.scale.view(groups), None if qw.zero is None else qw.zero.view(groups)
        scale_of = lambda a, b: slice(a // span, max(b // span, a // span + 1))  # noqa: E731
    elif width % group_size == 0:  # several whole groups per row
        pieces, step = width // group_size, max(1, TILE_ELEMENTS // width)
        scale, zero = qw.scale.view(rows, pieces, 1), None if qw.zero is None else qw.zero.view(rows, pieces, 1)
        scale_of = slice  # noqa: E731
    else:
        return quantized_matmul_reference(x, qw, transposed)
    flat = x.reshape(-1, x.shape[-1])
    parts = []
    for start in range(0, rows, step):
        end = min(start + step, rows)
        picked = scale_of(start, end)
        part = _tile_product(flat[:, start:end] if transposed else flat, qw.q[start:end], scale[picked],
                             None if zero is None else zero[picked], transposed)
        if transposed and parts:  # rows are input features: partial products add up
            parts[0] += part
        else:  # rows are output features: the parts are column blocks
            parts.append(part)
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out.view(*x.shape[:-1], out.shape[-1])


def quantized_matmul_reference(x: torch.Tensor, qw: QuantizedWeight, transposed: bool = False) -> torch.Tensor:
    """Plain version of :func:`quantized_matmul`: dequantize the whole matrix, then one matmul."""
    weight = dequantize(qw, x.dtype)
    return x @ weight if transposed else x @ weight.t()


def is_quantized(module: nn.Module) -> bool:
    """Whether :func:`quantize_weights` replaced this module's weight by int8 codes."""
    return "weight_q" in module._buffers


def _kind(module: nn.Module) -> str | None:
    """The kind of the module's weight: "linear", "embedding", or None (one that stays as it is)."""
    weight = module._parameters.get("weight")
    if weight is None or weight.dim() != 2 or not weight.is_floating_point():
        return None
    if isinstance(module, (nn.Embedding, HiddenParallelEmbedding, EmbeddingLayer)):
        # max_norm renormalises looked-up rows of the stored table in place: that table must stay float
        return None if getattr(module, "max_norm", None) is not None else "embedding"
    if isinstance(module, (nn.Linear, LinearLayer, LinearAllreduce)) or type(module).__name__ == "Conv1D":
        return "linear"
    return None


def _weight_users(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """id of every parameter -> the (module name, module, parameter name) that hold it (a tied one: several)."""
    users: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for name, module in model.named_modules():
        for pname, param in module._parameters.items():
            if param is not None:
                users.setdefault(id(param), []).append((name, module, pname))
    return users


def _stored(module: nn.Module) -> QuantizedWeight:
    return QuantizedWeight(module.weight_q, module.weight_scale, module._buffers.get("weight_zero"))


def _dequantize_hook(module: nn.Module, args: tuple) -> None:
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()),
                 module._dequant_dtype)
    # written into _parameters directly: the layer's own forward reads ``self.weight`` as usual, and a plain
    # tensor cannot be assigned to a registered parameter name through setattr
    module._parameters["weight"] = dequantize(_stored(module), dtype)


def _lookup_hook(module: nn.Module, args: tuple) -> tuple | None:
    """Embedding: dequantize only the rows this lookup reads and renumber the ids into that small table."""
    ids = args[0] if args else None
    # torch.unique has a data-dependent size, which a CUDA graph cannot capture: there, the whole table
    if not isinstance(ids, torch.Tensor) or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        _dequantize_hook(module, ())
        return None
    rows, local = torch.unique(ids, return_inverse=True)
    if rows.numel() and (rows[0] < 0 or rows[-1] >= module.weight_q.shape[0]):  # unique sorts: ends suffice
        raise IndexError(f"embedding lookup: ids must be in [0, {module.weight_q.shape[0]}), got "
                         f"{rows[0].item()}..{rows[-1].item()}")
    module._parameters["weight"] = dequantize_rows(_stored(module), rows, module._dequant_dtype)
    # padding_idx only steers gradients, but F.embedding checks it against the (now smaller) table's size
    module._lookup_padding_idx = getattr(module, "padding_idx", None)
    if module._lookup_padding_idx is not None:
        module.padding_idx = None
    return (local, *args[1:])


def _tiled_forward(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``forward`` of a quantized plain ``nn.Linear`` / HF ``Conv1D``: the tiled int8 matmul plus the bias."""
    if not hidden.is_floating_point() or not module._tiled_matmul:
        _dequantize_hook(module, (hidden,))  # the reference: the layer's own forward on the whole float weight
        try:
            return type(module).forward(module, hidden)
        finally:
            module._parameters["weight"] = None
    out = quantized_matmul(hidden, _stored(module), transposed=module._tiled_layout == "conv1d")
    return out if module.bias is None else out.add_(module.bias)


def _tiled_layout(module: nn.Module, shape: torch.Size) -> str | None:
    """"linear" / "conv1d" for a module whose forward is exactly ``x @ W.T + b`` / ``x @ W + b``; None otherwise
    (AutoTP's sharded layers communicate around their matmul: they keep their own forward on the float weight)."""
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return "linear"
    if type(module).__name__ == "Conv1D" and getattr(module, "nf", None) == shape[1]:
        return "conv1d"
    return None


def _drop_hook(module: nn.Module, args: tuple, output: object) -> None:
    module._parameters["weight"] = None
    padding_idx = module.__dict__.pop("_lookup_padding_idx", None)
    if padding_idx is not None:
        module.padding_idx = padding_idx


def _attach(module: nn.Module, qw: QuantizedWeight, kind: str, dtype: torch.dtype) -> None:
    """Make ``module`` hold ``qw`` instead of its float weight (buffers shared by every tied user)."""
    module.register_parameter("weight", None)
    module.register_buffer("weight_q", qw.q)
    module.register_buffer("weight_scale", qw.scale)
    if qw.zero is not None:
        module.register_buffer("weight_zero", qw.zero)
    # an embedding's input (token ids) carries no float dtype: it is dequantized to the original one
    module._dequant_dtype = dtype
    layout = _tiled_layout(module, qw.q.shape) if kind == "linear" else None
    if layout is not None:
        # an instance ``forward`` replaces the dequantize hook; a partial (not a bound method) so the module
        # still deep-copies and pickles. ``_tiled_matmul = False`` selects the reference path (tests, debugging).
        module._tiled_layout, module._tiled_matmul = layout, True
        module.forward = functools.partial(_tiled_forward, module)
    else:
        module.register_forward_pre_hook(_lookup_hook if kind == "embedding" else _dequantize_hook)
        module.register_forward_hook(_drop_hook)


def quantize_weights(model: nn.Module, num_bits: int = 8, groups: int = 1, q_type: str = "symmetric") -> list[str]:
    """Quantize, in place, the weight of every Linear-like and Embedding module (see the module docstring).

    A weight tied between such modules (embedding and lm_head) is quantized once; one also used by another
    kind of module, or under another name, stays float. Biases and norms keep their float dtype. Returns the
    names of the quantized modules.
    """
    todo = []
    for users in _weight_users(model).values():
        kinds = [_kind(module) if pname == "weight" else None for _, module, pname in users]
        if None not in kinds:  # (an already quantized weight is no parameter any more)
            todo.append((users, kinds))
    for users, _ in todo:  # every weight checked before the first is replaced: an error leaves the model whole
        try:
            _check_groups(users[0][1].weight.shape, groups)
        except ValueError as exc:
            raise ValueError(f"{users[0][0]}: {exc}") from None
    names = []
    for users, kinds in todo:
        first = users[0][1]
        qw, dtype = quantize(first.weight, num_bits, groups, q_type), first.weight.dtype
        for (name, module, _), kind in zip(users, kinds, strict=True):
            _attach(module, qw, kind, dtype)
            names.append(name)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(names, key=order.__getitem__)


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (accounting; a tied tensor counts once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total

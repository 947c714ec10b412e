"""Weight-only integer quantization of Linear and Embedding weights, dequantized on the fly (``dtype=torch.int8``).

A weight matrix is flattened and cut into ``q_groups`` equal groups; each group gets its own scale (and, for
``q_type="asymmetric"``, its own zero point). Values are stored as ``int8`` whatever ``num_bits`` (<= 8) is, so
memory is 1 byte per weight element plus 4 bytes per group. The module keeps its class and its ``forward``; its
``weight`` reads ``None`` between calls: a pre-forward hook rebuilds it just before the module runs (a Linear:
the whole matrix in the activation dtype; an Embedding: only the rows looked up, in the original dtype) and a
forward hook drops it afterwards, so the float weight only exists while its own layer runs. Covered:
``nn.Linear``, Hugging Face's ``Conv1D`` (GPT-2), ``nn.Embedding`` and AutoTP's sharded replacements of all
three. A weight tied between modules (embedding and lm_head) is quantized once and its int8 buffers are shared.
"""

from __future__ import annotations

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

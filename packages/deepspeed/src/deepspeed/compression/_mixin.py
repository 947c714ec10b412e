"""State and behaviour every compression-aware layer shares: weight quantization (with its bit schedule), sparse
pruning, structured pruning along the output dimension (rows of a Linear, channels of a Conv2d) and activation
quantization.

A technique is *configured* by ``enable_*`` (``init_compression``) and *switched on* by the compression scheduler
at its ``schedule_offset`` (the ``*_enabled`` flags); ``fix_*`` (``redundancy_clean``) bakes it into the weights.
Masks are applied in ``forward`` (the parameters keep their values), so a learnable top-k mask can still change.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepspeed.compression.utils import SYMMETRIC, QuantAct, TopKBinarizer, fake_quantize, topk_mask

PRUNING_METHODS = ("l1", "topk")
# learnable score parameter of each pruning kind (DeepSpeed's names, so its checkpoints keep loading)
SCORE_NAMES = {"sparse": "sparse_mask_scores", "row": "row_mask_scores", "channel": "channel_mask_scores",
               "head": "head_pruning_scores"}


def replace_parameter(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Give ``module.<name>`` a new (smaller) tensor, keeping ``requires_grad``."""
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.detach().clone(), requires_grad=old.requires_grad))


def _kaiming_scores(shape: tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    scores = nn.Parameter(torch.empty(shape, device=like.device, dtype=like.dtype))
    nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


class CompressionMixin:
    """Mixed into ``nn.Linear``/``nn.Conv2d``/``nn.Embedding`` subclasses; ``weight`` is the compressed tensor."""

    weight: nn.Parameter

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # the torch layer's own arguments
        self.init_compression_state()

    def init_compression_state(self) -> None:
        """Every technique configured off (called by the constructors and by in-place conversion)."""
        self.weight_quantization_enabled = False  # switched on by the scheduler at schedule_offset
        self.weight_quantization_enabled_in_forward = False
        self.weight_quantize_start_bits: int | None = None
        self.weight_quantize_target_bits: int | None = None
        self.weight_quantize_period: int | None = None
        self.weight_quantize_bits: int | None = None  # the schedule's current bits
        self.weight_quantize_type = SYMMETRIC
        self.weight_quantize_num_groups = 1
        self.weight_quantize_rounding = "nearest"
        self.weight_quantize_real_ratio = 0.0  # fp16_mixed_quantize: share of the unquantized weight
        self.sparse_pruning_method: str | None = None
        self.sparse_pruning_enabled = False
        self.activation_quantization_method: str | None = None
        self.activation_quantization_enabled = False

    # ---- weight quantization ------------------------------------------------------------------------------
    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int, rounding: str = "nearest") -> None:
        """Configure quantization from ``start_bits`` down to ``target_bits`` (one bit per
        ``quantization_period`` steps), ``num_groups`` scales per weight, in forward or after each step."""
        if target_bits > start_bits:
            raise ValueError(f"weight quantization: target_bits ({target_bits}) must be <= start_bits ({start_bits})")
        if target_bits <= 2 and quantization_type != SYMMETRIC:
            raise ValueError(f"weight quantization to {target_bits} bit(s) (ternary/binary) is symmetric only; "
                             f"got quantization_type={quantization_type!r}")
        if self.weight.numel() % num_groups:
            raise ValueError(f"quantize_groups={num_groups} must divide the weight of {type(self).__name__} "
                             f"{tuple(self.weight.shape)} ({self.weight.numel()} elements)")
        self.weight_quantize_start_bits = self.weight_quantize_bits = start_bits
        self.weight_quantize_target_bits = target_bits
        self.weight_quantize_period = quantization_period
        self.weight_quantization_enabled_in_forward = weight_quantization_enabled_in_forward
        self.weight_quantize_type = quantization_type
        self.weight_quantize_num_groups = num_groups
        self.weight_quantize_rounding = rounding

    def set_weight_quantization_state(self, bits: int, real_ratio: float = 0.0) -> None:
        """The scheduler's current ``bits`` and the unquantized share ``real_ratio`` (fp16_mixed_quantize)."""
        self.weight_quantize_bits = bits
        self.weight_quantize_real_ratio = real_ratio

    def quantized_weight(self, weight: torch.Tensor, bits: int | None = None) -> torch.Tensor:
        """``weight`` on the ``bits`` grid (default: the current bits), blended with the unquantized value while
        ``fp16_mixed_quantize`` ramps up; straight-through gradient."""
        bits = self.weight_quantize_bits if bits is None else bits
        q = fake_quantize(weight, bits, self.weight_quantize_type, self.weight_quantize_num_groups,
                          self.weight_quantize_rounding)
        ratio = self.weight_quantize_real_ratio
        return q if ratio <= 0 else ratio * weight + (1 - ratio) * q

    @torch.no_grad()
    def quantize_weight_in_place(self) -> None:
        """Optimizer-step mode: store the current quantized weight (the optimizer's fp32 masters stay exact)."""
        self.weight.data.copy_(self.quantized_weight(self.weight.data))

    @torch.no_grad()
    def fix_weight_quantization(self) -> None:
        """``redundancy_clean``: store the weight quantized at ``target_bits`` and stop quantizing in forward."""
        if self.weight_quantize_target_bits is None:
            return
        self.weight_quantize_real_ratio = 0.0
        self.weight.data.copy_(self.quantized_weight(self.weight.data, self.weight_quantize_target_bits))
        self.weight_quantize_bits = self.weight_quantize_target_bits
        self.weight_quantization_enabled = self.weight_quantization_enabled_in_forward = False

    # ---- pruning masks --------------------------------------------------------------------------------------
    def _l1_scores(self, kind: str) -> torch.Tensor:
        w = self.weight.detach().float().abs()
        if kind == "sparse":
            return w
        return w.sum(dim=tuple(range(1, w.dim())), keepdim=True)  # row / channel: L1 norm of each output slice

    def _enable_pruning(self, kind: str, ratio: float, method: str) -> None:
        if method not in PRUNING_METHODS:
            raise ValueError(f"{kind} pruning: method {method!r} is not supported; accepted: {PRUNING_METHODS}")
        if not 0 < ratio <= 1:
            raise ValueError(f"{kind} pruning: dense_ratio must be in (0, 1], got {ratio}")
        setattr(self, f"{kind}_pruning_ratio", ratio)
        setattr(self, f"{kind}_pruning_method", method)
        setattr(self, f"{kind}_pruning_enabled", False)
        mask = None
        if method == "l1":
            mask = topk_mask(self._l1_scores(kind), ratio).to(self.weight.dtype)
        else:
            shape = self._l1_scores(kind).shape
            setattr(self, SCORE_NAMES[kind], _kaiming_scores(tuple(shape), self.weight))
        self.register_buffer(f"{kind}_pruning_mask", mask)

    def enable_sparse_pruning(self, ratio: float, method: str) -> None:
        """Keep the ``ratio`` share of weights: the largest magnitudes (``l1``, fixed) or learned scores (``topk``)."""
        self._enable_pruning("sparse", ratio, method)

    def activate(self, kind: str) -> None:
        """Switch technique ``kind`` on (the scheduler, at its offset); an ``l1`` mask is re-taken from the
        weights as they are now, so warm-up steps count."""
        flag = f"{kind}_enabled" if kind.endswith("quantization") else f"{kind}_pruning_enabled"
        if getattr(self, flag, True):
            return
        setattr(self, flag, True)
        if not kind.endswith("quantization") and getattr(self, f"{kind}_pruning_method", None) == "l1":
            ratio = getattr(self, f"{kind}_pruning_ratio")
            getattr(self, f"{kind}_pruning_mask").copy_(topk_mask(self._l1_scores(kind), ratio))

    def get_mask(self, pruning_type: str = "sparse") -> torch.Tensor:
        """The current 0/1 mask of ``pruning_type`` (sparse: weight-shaped; row/channel: one per output slice;
        head: ``(1, num_heads)``)."""
        method = getattr(self, f"{pruning_type}_pruning_method", None)
        if method == "l1":
            return getattr(self, f"{pruning_type}_pruning_mask")
        if method == "topk":
            return TopKBinarizer.apply(getattr(self, SCORE_NAMES[pruning_type]),
                                       getattr(self, f"{pruning_type}_pruning_ratio"), False)
        raise ValueError(f"{type(self).__name__}: {pruning_type} pruning is not configured on this layer")

    def _drop_pruning_state(self, kind: str) -> None:
        for name in (f"{kind}_pruning_mask", SCORE_NAMES[kind]):
            if hasattr(self, name):
                delattr(self, name)
        setattr(self, f"{kind}_pruning_method", None)
        setattr(self, f"{kind}_pruning_enabled", False)

    @torch.no_grad()
    def fix_sparse_pruning_helper(self) -> None:
        """``redundancy_clean``: zero the pruned weights for good and drop the mask."""
        self.weight.data.mul_(self.get_mask("sparse").detach().to(self.weight.dtype))
        self._drop_pruning_state("sparse")

    # ---- activation quantization ----------------------------------------------------------------------------
    def enable_activation_quantization(self, bits: int, quantization_type: str, range_calibration: str) -> None:
        """Quantize this layer's input to ``bits``: per token/image (``dynamic``) or with a momentum-tracked
        min/max (``static``)."""
        if bits < 2:
            raise ValueError(f"activation quantization needs at least 2 bits, got {bits}")
        if range_calibration not in ("static", "dynamic"):
            raise ValueError(f"range_calibration {range_calibration!r}; accepted: 'static', 'dynamic'")
        self.activation_quantization_bits = bits
        self.activation_quantization_type = quantization_type
        self.activation_quantization_method = f"{quantization_type}_{range_calibration}"
        if range_calibration == "static":
            self.activation_quantizer = QuantAct(quant_mode=quantization_type)

    def _activation_groups(self, x: torch.Tensor) -> int:
        return x.numel() // x.shape[-1]  # Linear: one range per token

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """The layer input as the activation quantization sees it (unchanged when off)."""
        if not (self.activation_quantization_enabled and self.activation_quantization_method):
            return x
        if self.activation_quantization_method.endswith("static"):
            return self.activation_quantizer(x, self.activation_quantization_bits)
        return fake_quantize(x, self.activation_quantization_bits, self.activation_quantization_type,
                             self._activation_groups(x))

    # ---- forward helpers -------------------------------------------------------------------------------------
    def compressed_weight(self) -> torch.Tensor:
        """The weight the forward uses: quantized (forward mode) and sparse-masked as switched on."""
        weight = self.weight
        if self.weight_quantization_enabled and self.weight_quantization_enabled_in_forward:
            weight = self.quantized_weight(weight)
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            weight = weight * self.get_mask("sparse")
        return weight

    def compression_repr(self) -> str:
        return (f"sparse_pruning={self.sparse_pruning_method}, weight_quantization={self.weight_quantize_bits}, "
                f"activation_quantization={self.activation_quantization_method}")


def output_mask(mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A per-output-slice mask broadcastable against ``weight`` (``(out, 1, ...)``)."""
    return mask.reshape(-1, *([1] * (weight.dim() - 1)))


def as_bool(mask: Any) -> torch.Tensor:
    """A flat boolean keep-mask."""
    return mask.detach().reshape(-1).bool()

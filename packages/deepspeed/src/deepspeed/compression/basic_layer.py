"""Compression-aware layers: drop-in subclasses of ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding`` and
``nn.BatchNorm2d`` that apply the configured quantization and pruning in ``forward``, and shrink themselves in
``redundancy_clean`` (``fix_*_helper``). ``init_compression`` converts a model's layers to these classes in place,
so parameters (and weight tying) are kept.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from deepspeed.compression._mixin import (
    CompressionMixin,
    _kaiming_scores,
    as_bool,
    output_mask,
    replace_parameter,
)
from deepspeed.compression._mp_region import Copy, Gather, Reduce, Scatter
from deepspeed.compression.utils import QuantAct as QuantAct  # DeepSpeed's path for it


def _keep_outputs(layer: nn.Module, keep: torch.Tensor, dim_reduction: bool) -> None:
    """Keep the output rows / filters (weight dim 0, bias) where ``keep`` is True: the others are removed with
    ``dim_reduction``, else zeroed in place (the shapes stay)."""
    if dim_reduction:
        replace_parameter(layer, "weight", layer.weight[keep])
        if layer.bias is not None:
            replace_parameter(layer, "bias", layer.bias[keep])
    else:
        layer.weight.data.mul_(output_mask(keep, layer.weight).to(layer.weight.dtype))
        if layer.bias is not None:
            layer.bias.data.mul_(keep.to(layer.bias.dtype))


class LinearLayer_Compress(CompressionMixin, nn.Linear):  # DeepSpeed's class name
    """``nn.Linear`` with weight/activation quantization, sparse, row and head pruning."""

    def init_compression_state(self) -> None:
        super().init_compression_state()
        self.row_pruning_method: str | None = None
        self.row_pruning_enabled = False
        self.head_pruning_method: str | None = None
        self.head_pruning_enabled = False

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, {self.compression_repr()}, row_pruning={self.row_pruning_method}, "
                f"head_pruning={self.head_pruning_method}")

    def enable_row_pruning(self, ratio: float, method: str) -> None:
        """Keep the ``ratio`` share of output rows (``l1``: largest row L1 norms; ``topk``: learned scores)."""
        self._enable_pruning("row", ratio, method)

    def enable_head_pruning(self, ratio: float, method: str, num_heads: int) -> None:
        """Keep the ``ratio`` share of the ``num_heads`` attention heads feeding this output projection (its input
        columns, one block per head); learned scores (``topk`` only)."""
        if method != "topk":
            raise ValueError(f"head pruning: method {method!r} is not supported; accepted: ('topk',)")
        if self.in_features % num_heads:
            raise ValueError(f"head pruning: num_heads={num_heads} must divide in_features={self.in_features}")
        self.num_heads = num_heads
        self.head_pruning_ratio = ratio
        self.head_pruning_method = method
        self.head_pruning_enabled = False
        self.head_pruning_scores = _kaiming_scores((1, num_heads), self.weight)

    def _head_columns(self, head_mask: torch.Tensor) -> torch.Tensor:
        return head_mask.reshape(-1).repeat_interleave(self.in_features // self.num_heads)

    def forward(self, input: torch.Tensor, skip_bias_add: bool = False):
        weight, bias = self.compressed_weight(), self.bias
        if self.row_pruning_enabled and self.row_pruning_method:
            mask = self.get_mask("row")
            weight = weight * output_mask(mask, weight)
            bias = bias * mask.reshape(-1) if bias is not None else None
        if self.head_pruning_enabled and self.head_pruning_method:
            weight = weight * self._head_columns(self.get_mask("head")).unsqueeze(0)
        input = self.quantize_input(input)
        if skip_bias_add:  # model-parallel linears hand the bias back to the caller
            return F.linear(input, weight, None), bias
        return F.linear(input, weight, bias)

    @torch.no_grad()
    def fix_row_col_pruning_helper(self, mask: torch.Tensor | None = None, dim_reduction: bool = False):
        """Without ``mask``: bake this layer's row pruning in (remove the rows with ``dim_reduction``, else zero
        them) and return the kept-row mask. With ``mask`` (the previous layer's rows): remove those input columns."""
        if mask is not None:
            keep = as_bool(mask)
            if keep.numel() != self.in_features:
                raise ValueError(f"related module has in_features={self.in_features} but the pruned layer has "
                                 f"{keep.numel()} rows")
            replace_parameter(self, "weight", self.weight[:, keep])
            self.in_features = self.weight.shape[1]
            return None
        keep = as_bool(self.get_mask("row"))
        _keep_outputs(self, keep, dim_reduction)
        self.out_features = self.weight.shape[0]
        self._drop_pruning_state("row")
        return keep

    @torch.no_grad()
    def fix_head_pruning_helper(self, mask: torch.Tensor | None = None, num_heads: int | None = None,
                                dim_reduction: bool = False):
        """Without ``mask`` (the output projection): remove (or zero) the input columns of pruned heads and return
        the kept-head mask. With ``mask`` (Q/K/V): remove the output rows of the pruned heads."""
        if mask is not None:
            keep = as_bool(mask)
            heads = num_heads or keep.numel()
            if self.out_features % heads:
                raise ValueError(f"head pruning: num_heads={heads} must divide the related module's "
                                 f"out_features={self.out_features}")
            _keep_outputs(self, keep.repeat_interleave(self.out_features // heads), dim_reduction=True)
            self.out_features = self.weight.shape[0]
            return None
        keep = as_bool(self.get_mask("head"))
        cols = self._head_columns(keep)
        if dim_reduction:
            replace_parameter(self, "weight", self.weight[:, cols])
            self.in_features = self.weight.shape[1]
        else:
            self.weight.data.mul_(cols.to(self.weight.dtype).unsqueeze(0))
        self._drop_pruning_state("head")
        return keep


class Conv2dLayer_Compress(CompressionMixin, nn.Conv2d):  # DeepSpeed's class name
    """``nn.Conv2d`` with weight/activation quantization, sparse and channel (output filter) pruning."""

    def init_compression_state(self) -> None:
        super().init_compression_state()
        self.channel_pruning_method: str | None = None
        self.channel_pruning_enabled = False

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.compression_repr()}, channel_pruning={self.channel_pruning_method}"

    def enable_channel_pruning(self, ratio: float, method: str) -> None:
        """Keep the ``ratio`` share of output channels (``l1``: largest filter L1 norms; ``topk``: learned)."""
        self._enable_pruning("channel", ratio, method)

    def _activation_groups(self, x: torch.Tensor) -> int:
        return x.shape[0] if x.dim() == 4 else 1  # one range per image

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self.compressed_weight(), self.bias
        if self.channel_pruning_enabled and self.channel_pruning_method:
            mask = self.get_mask("channel")
            weight = weight * output_mask(mask, weight)
            bias = bias * mask.reshape(-1) if bias is not None else None
        return self._conv_forward(self.quantize_input(input), weight, bias)

    @torch.no_grad()
    def fix_channel_pruning_helper(self, mask: torch.Tensor | None = None, dim_reduction: bool = False):
        """Without ``mask``: bake this layer's channel pruning in (remove the filters with ``dim_reduction``, else
        zero them), return the kept-channel mask. With ``mask``: remove those input channels."""
        if mask is not None:
            keep = as_bool(mask)
            if self.groups != 1 or keep.numel() != self.in_channels:
                raise ValueError(f"channel pruning: the related Conv2d (in_channels={self.in_channels}, "
                                 f"groups={self.groups}) cannot drop input channels of a {keep.numel()}-channel "
                                 "layer; related convolutions need groups=1 and matching channels")
            replace_parameter(self, "weight", self.weight[:, keep])
            self.in_channels = self.weight.shape[1]
            return None
        keep = as_bool(self.get_mask("channel"))
        if dim_reduction and self.groups != 1:
            raise ValueError(f"channel pruning with related modules needs groups=1, got groups={self.groups}")
        _keep_outputs(self, keep, dim_reduction)
        self.out_channels = self.weight.shape[0]
        self._drop_pruning_state("channel")
        return keep


class Embedding_Compress(CompressionMixin, nn.Embedding):  # DeepSpeed's class name
    """``nn.Embedding`` with weight quantization (one scale per token row, as DeepSpeed does)."""

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight_quantization={self.weight_quantize_bits}"

    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int, rounding: str = "nearest") -> None:
        # token-wise groups whatever quantize_groups says: rows of an embedding have very different ranges
        super().enable_weight_quantization(start_bits, target_bits, quantization_period,
                                           weight_quantization_enabled_in_forward, quantization_type,
                                           self.num_embeddings, rounding)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.embedding(input, self.compressed_weight(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


class BNLayer_Compress(nn.BatchNorm2d):  # DeepSpeed's class name
    """``nn.BatchNorm2d`` that follows the channel pruning of the convolution before it."""

    @torch.no_grad()
    def fix_channel_pruning_helper(self, mask: torch.Tensor, dim_reduction: bool = True) -> None:
        """Keep the statistics and affine parameters of the channels in ``mask`` only."""
        keep = as_bool(mask)
        if keep.numel() != self.num_features:
            raise ValueError(f"channel pruning: BatchNorm2d has {self.num_features} features but the pruned "
                             f"convolution has {keep.numel()} channels")
        if self.affine:
            replace_parameter(self, "weight", self.weight[keep])
            replace_parameter(self, "bias", self.bias[keep])
        if self.track_running_stats:
            self.running_mean = self.running_mean[keep].clone()
            self.running_var = self.running_var[keep].clone()
        self.num_features = int(keep.sum())


# Megatron-style model-parallel linears of an ``mpu`` (its ``ColumnParallelLinear`` / ``RowParallelLinear``): each
# rank holds its weight shard, a column layer [output_size / P, input_size], a row layer [output_size, input_size / P]
# (P = mpu.get_model_parallel_world_size()); both return ``(output, bias)`` as Megatron's layers do, the bias unadded
# with ``skip_bias_add``. Compression acts on the local shard, as in DeepSpeed.
def _model_parallel_size(mpu: Any, size: int, what: str) -> int:
    world = mpu.get_model_parallel_world_size()
    if size % world:
        raise ValueError(f"{what}={size} is not divisible by the model-parallel world size {world}")
    return size // world


class ColumnParallelLinear_Compress(LinearLayer_Compress):  # noqa: N801 - DeepSpeed's class name
    """Column-parallel linear (output features split over the group) with compression; ``gather_output``
    all-gathers the output shards into the whole output."""

    def __init__(self, mpu: Any, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 skip_bias_add: bool = False) -> None:
        per_rank = _model_parallel_size(mpu, output_size, "ColumnParallelLinear_Compress: output_size")
        super().__init__(input_size, per_rank, bias=bias)
        self.mpu, self.input_size, self.output_size = mpu, input_size, output_size
        self.output_size_per_partition = per_rank
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        group = self.mpu.get_model_parallel_group()
        hidden = Copy.apply(input_, group)
        if self.skip_bias_add:
            out, bias = super().forward(hidden, True)
        else:
            out, bias = super().forward(hidden), None
        return (Gather.apply(out, group) if self.gather_output else out), bias


class RowParallelLinear_Compress(LinearLayer_Compress):  # noqa: N801 - DeepSpeed's class name
    """Row-parallel linear (input features split over the group) with compression: partial outputs are summed
    over the group and the (replicated) bias added once, or handed back with ``skip_bias_add``."""

    def __init__(self, mpu: Any, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = False, skip_bias_add: bool = False) -> None:
        per_rank = _model_parallel_size(mpu, input_size, "RowParallelLinear_Compress: input_size")
        super().__init__(per_rank, output_size, bias=bias)
        self.mpu, self.input_size, self.output_size = mpu, input_size, output_size
        self.input_size_per_partition = per_rank
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        group = self.mpu.get_model_parallel_group()
        hidden = input_ if self.input_is_parallel else Scatter.apply(input_, group)
        partial, bias = super().forward(hidden, True)
        out = Reduce.apply(partial, group)
        if self.skip_bias_add:
            return out, bias
        return (out + bias if bias is not None else out), None


COMPRESS_CLASSES: tuple[tuple[type[nn.Module], type[nn.Module]], ...] = (
    (nn.Linear, LinearLayer_Compress),
    (nn.Conv2d, Conv2dLayer_Compress),
    (nn.Embedding, Embedding_Compress),
    (nn.BatchNorm2d, BNLayer_Compress),
)
"""Plain layer type -> its compression-aware subclass."""

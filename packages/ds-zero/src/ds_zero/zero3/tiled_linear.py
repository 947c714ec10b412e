"""``TiledLinear``: memory-centric tiling (ZeRO-Infinity) of a linear layer, DeepSpeed's
``deepspeed.runtime.zero.tiling``.

The ``out_features x in_features`` weight is cut into ``out_splits x in_splits`` tiles, each its own
``linear_cls`` submodule (``linears[out_id][in_id]``), run one after the other. Under ZeRO-3 every tile is a
gather unit of its own, so only one tile's parameters (and, in backward, its gradients) need to be whole at a
time: the working memory of the layer falls with the number of tiles. Tile ``(o, i)`` maps input features
``in_parts[i]:in_parts[i+1]`` to output features ``out_parts[o]:out_parts[o+1]``; the outputs of one row of
tiles are summed, and the rows are concatenated. The bias of an output row lives on its last input tile
(``linears[o][in_splits - 1].bias``), so the state-dict keys are DeepSpeed's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds_zero.zero3.init import GatheredParameters
from ds_zero.zero3.param import is_partitioned

__all__ = ["TiledLinear", "TiledLinearReturnBias", "TilingError", "partition_uniform", "split_tensor_along_last_dim"]


class TilingError(ValueError, RuntimeError):
    """A bad ``TiledLinear`` argument. A ``ValueError``, and a ``RuntimeError`` as DeepSpeed raises."""


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """CSR-style boundaries ``[0, ..., num_items]`` of ``num_parts`` near-equal parts (the first
    ``num_items % num_parts`` parts one item longer), as DeepSpeed's ``partition_uniform``."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions: int | Sequence[int],
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` along its last dimension into ``partitions`` (a count of equal parts, or the sizes)."""
    if isinstance(partitions, int):
        if tensor.shape[-1] % partitions:
            raise TilingError(f"split_tensor_along_last_dim: the last dimension ({tensor.shape[-1]}) is not divisible "
                              f"by partitions={partitions}")
        partitions = tensor.shape[-1] // partitions
    chunks = torch.split(tensor, partitions, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


def _check_splits(name: str, splits: Any, features: int, features_name: str) -> int:
    if isinstance(splits, bool) or not isinstance(splits, int):
        raise TypeError(f"TiledLinear: {name} must be an int, got {type(splits).__name__}")
    if not 1 <= splits <= features:
        raise TilingError(f"TiledLinear: {name}={splits} must be in the range [1, {features_name}={features}]")
    return splits


def _check_features(name: str, features: Any) -> int:
    if isinstance(features, bool) or not isinstance(features, int) or features < 1:
        raise TilingError(f"TiledLinear: {name} must be a positive int, got {features!r}")
    return features


class TiledLinear(torch.nn.Module):
    """A ``torch.nn.Linear`` replacement split into ``out_splits x in_splits`` tiles that ZeRO-3 gathers one
    at a time (DeepSpeed's ``deepspeed.zero.TiledLinear``).

    ``input_is_already_split``: ``forward`` receives a sequence of ``in_splits`` input chunks (sized as
    ``in_parts``) instead of one tensor. ``combine_out_splits=False``: ``forward`` returns the list of the
    ``out_splits`` output chunks instead of their concatenation. ``linear_cls`` builds each tile as
    ``linear_cls(in_dim, out_dim, bias=..., **kwargs)``; ``init_linear``: a linear layer whose weight and bias
    are copied in (``copy_params_from``). Raises ``TilingError`` (a ``ValueError`` and ``RuntimeError``) for
    splits outside ``[1, features]``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: Any = torch.nn.Linear, init_linear: torch.nn.Module | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        self.in_features = _check_features("in_features", in_features)
        self.out_features = _check_features("out_features", out_features)
        self.in_splits = _check_splits("in_splits", in_splits, in_features, "in_features")
        self.out_splits = _check_splits("out_splits", out_splits, out_features, "out_features")
        self.use_bias = bool(bias)
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for out_id in range(out_splits):
            row = torch.nn.ModuleList()
            self.linears.append(row)
            out_dim = self.out_parts[out_id + 1] - self.out_parts[out_id]
            for in_id in range(in_splits):
                in_dim = self.in_parts[in_id + 1] - self.in_parts[in_id]
                tile_bias = self.use_bias and in_id == in_splits - 1  # one bias per output row
                row.append(linear_cls(in_dim, out_dim, bias=tile_bias, **kwargs))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, "
                f"in_splits={self.in_splits}, out_splits={self.out_splits}")

    # ---- forward ---------------------------------------------------------------------------------------------
    def _inputs(self, input_: Any) -> Sequence[Any]:
        if self.in_splits == 1 and not self.input_is_already_split:
            return [input_]
        if not self.input_is_already_split:
            sizes = [self.in_parts[i + 1] - self.in_parts[i] for i in range(self.in_splits)]
            if input_.shape[-1] != self.in_features:
                raise TilingError(f"TiledLinear: the input's last dimension is {input_.shape[-1]}, expected "
                                  f"in_features={self.in_features}")
            return self._split_global_input(input_, sizes)
        if isinstance(input_, torch.Tensor) or len(input_) != self.in_splits:
            got = "one tensor" if isinstance(input_, torch.Tensor) else f"{len(input_)} chunks"
            raise TilingError(f"TiledLinear: input_is_already_split=True expects in_splits={self.in_splits} "
                              f"input chunks, got {got}")
        return input_

    def forward(self, input_: Any) -> Any:
        inputs = self._inputs(input_)
        outputs: list[Any] = [None] * self.out_splits
        for out_id in range(self.out_splits):
            for in_id in range(self.in_splits):
                local = self.linears[out_id][in_id](inputs[in_id])
                outputs[out_id] = self._reduce_local_output(in_id=in_id, out_id=out_id,
                                                            current_out=outputs[out_id], new_out=local)
        if self.combine_out_splits:
            return self._combine_output_splits(outputs)
        return outputs

    def _split_global_input(self, input: torch.Tensor, split_sizes: list[int]) -> Sequence[Any]:  # noqa: A002
        """Cut the input along its last dimension into ``split_sizes`` (override for other input types)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Add tile ``(out_id, in_id)``'s output into its row's running sum (override for other output types)."""
        if current_out is None:
            return new_out
        return current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """Join the rows' outputs into one tensor along the last dimension."""
        return torch.cat(outputs, dim=-1)

    # ---- parameters ------------------------------------------------------------------------------------------
    def _check_source(self, other: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = getattr(other, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TilingError(f"TiledLinear.copy_params_from: other ({type(other).__name__}) has no weight tensor")
        shape = tuple(getattr(weight, "ds_shape", weight.shape))
        if shape != (self.out_features, self.in_features):
            raise TilingError(f"TiledLinear.copy_params_from: other.weight has shape {shape}, expected "
                              f"(out_features, in_features)=({self.out_features}, {self.in_features})")
        bias = getattr(other, "bias", None)
        if self.use_bias != (bias is not None):
            raise TilingError(f"TiledLinear.copy_params_from: bias={self.use_bias} but other.bias is "
                              f"{'missing' if bias is None else 'present'}")
        if bias is not None and tuple(getattr(bias, "ds_shape", bias.shape)) != (self.out_features,):
            raise TilingError(f"TiledLinear.copy_params_from: other.bias has shape "
                              f"{tuple(getattr(bias, 'ds_shape', bias.shape))}, expected ({self.out_features},)")
        return weight, bias

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy ``other``'s weight and bias (a linear layer of the full size) into the tiles.

        Under ZeRO-3 this is collective: every rank of the tiles' group must call it; rank 0's values of
        ``other`` become every rank's (``GatheredParameters(modifier_rank=0)``). ``other`` may itself be
        partitioned (built under ``zero.Init``); it is gathered for the copy.
        """
        weight, bias = self._check_source(other)
        sources = [t for t in (weight, bias) if t is not None and is_partitioned(t)]
        with GatheredParameters(sources):
            for out_id in range(self.out_splits):
                r0, r1 = self.out_parts[out_id], self.out_parts[out_id + 1]
                for in_id in range(self.in_splits):
                    c0, c1 = self.in_parts[in_id], self.in_parts[in_id + 1]
                    tile = self.linears[out_id][in_id]
                    params = [tile.weight] + ([tile.bias] if tile.bias is not None else [])
                    with GatheredParameters(params, modifier_rank=0):
                        tile.weight.data.copy_(weight[r0:r1, c0:c1])
                        if tile.bias is not None:
                            tile.bias.data.copy_(bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """``TiledLinear`` over tiles that return ``(output, bias)`` (Megatron-LM's ``skip_bias_add`` linears):
    the outputs are summed and concatenated, the biases are concatenated, not added."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2) or new_out[0] is None:
            raise TilingError(f"TiledLinearReturnBias: tile ({out_id}, {in_id}) must return (output, bias), got "
                              f"{type(new_out).__name__}")
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, bias if bias is not None else old_bias

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensor = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return tensor, super()._combine_output_splits(biases) if biases else None

"""DeepSpeed's sub-parameter and model-specific tensor-parallel layers, as thin constructors over
:class:`LinearLayer` / :class:`LinearAllreduce` (one split machinery: :mod:`._linear_split`).

``SubParamLinearLayer(module, mp_group, shape=((q, k, v), -1), partition_dim=0)`` cuts each packed
sub-parameter on its own; ``GateUpPack_LinearLayer`` is the chatGLM gate/up pair (two halves, split as MLP
widths); ``fused_LinearLayer`` a fused QKV projection whose layout depends on the model family
(``fused_module``); the Yuan layers select noncontiguous head groups, which universal checkpoints cannot
describe: they record why, and refuse to gather.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_inference.autotp._layers import LinearAllreduce, LinearLayer
from ds_inference.autotp.split_rules import model_facts
from ds_inference.autotp.subparam_spec import parse_subparam_view
from ds_inference.autotp.uc_meta import shape_before_zero3


class _SubParamMixin:
    """Publishes the user's ``shape`` spec (not the resolved sizes) as the weight's ``sub_param_shape``, and the
    per-rank widths even for a single block, as DeepSpeed does."""

    def _subparam_spec(self, bias: bool) -> tuple | None:
        if not bias:
            return self.shape
        if self._bias_dim is None:
            return None
        sizes = self._subparam_sizes
        return tuple(tuple(sizes) if i == self._bias_dim and sizes is not None else d
                     for i, d in enumerate(self._output_shape))

    def _split_fields(self, bias: bool) -> dict:
        return {"sub_param_shape": self._subparam_spec(bias), "sub_param_sizes": self._subparam_sizes,
                "sub_param_shard_widths": self._subparam_shard_widths}


def _view(module: nn.Module, shape: Any, partition_dim: int, name: str | None) -> Any:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"cannot shard {type(module).__name__}: it has no weight tensor")
    view = parse_subparam_view(shape_before_zero3(weight), shape, partition_dim, name)
    bias = getattr(module, "bias", None)
    if bias is not None and math.prod(shape_before_zero3(bias)) != math.prod(view.output):
        raise ValueError(f"AutoTP layer '{name}': bias of {bias.numel()} elements for the output shape {view.output}")
    return view


class SubParamLinearLayer(_SubParamMixin, LinearLayer):
    """Column-parallel linear whose weight packs sub-parameters along ``partition_dim`` of the ``shape`` view."""

    def __init__(self, module: nn.Module, mp_group: dist.ProcessGroup | None = None, shape: Any = None,
                 partition_dim: int = 0, *, name: str | None = None, device: torch.device | None = None) -> None:
        view = _view(module, shape, partition_dim, name)
        self.shape = tuple(shape) if isinstance(shape, list) else shape
        super().__init__(module, mp_group, name=name, device=device, _subparams=(view, partition_dim))


class SubParamLinearAllreduce(_SubParamMixin, LinearAllreduce):
    """Row-parallel linear with sub-parameters along ``partition_dim`` (the input features by default)."""

    def __init__(self, module: nn.Module, mp_group: dist.ProcessGroup | None = None, shape: Any = None,
                 partition_dim: int = 1, *, name: str | None = None, device: torch.device | None = None) -> None:
        view = _view(module, shape, partition_dim, name)
        self.shape = tuple(shape) if isinstance(shape, list) else shape
        super().__init__(module, mp_group, name=name, device=device, _subparams=(view, partition_dim))


class GateUpPack_LinearLayer(LinearLayer):  # noqa: N801 - DeepSpeed's class name
    """chatGLM's packed gate/up projection: the two halves of the output are split separately, as MLP widths."""

    def _split_name(self) -> object:
        return "mlp"

    def _default_subparam_sizes(self, out_features: int) -> tuple[int, ...] | None:
        if out_features % 2:
            raise ValueError(f"GateUpPack_LinearLayer '{self.name}': {out_features} output features do not make "
                             "two equal halves")
        return (out_features // 2, out_features // 2)


# DeepSpeed's fused-QKV families, by the class name of the block holding the projection
_FUSED_TYPES = {"CodeGenBlock": "codegen", "BloomBlock": "bloom", "GLMBlock": "glm", "MPTBlock": "glm",
                "MptBlock": "glm", "BaichuanLayer": "glm", "QWenBlock": "qwen", "FalconDecoderLayer": "bloom",
                "GPTBigCodeBlock": "bigcode", "DecoderLayer": "glm", "Phi3DecoderLayer": "phi3"}
_INTERLEAVED = ("its fused qkv layout interleaves or replicates blocks across tensor parallel ranks, so the "
                "original parameter cannot be reassembled from the shards")


def fused_qkv_type(fused_module: nn.Module) -> str:
    """The family of a fused-QKV block (the longest matching class name; unknown blocks are bloom-like)."""
    text = str(fused_module).strip()
    matches = [key for key in _FUSED_TYPES if key in text]
    return _FUSED_TYPES[max(matches, key=len)] if matches else "bloom"


def fused_qkv_sizes(fused_module: nn.Module, weight_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Sub-parameter sizes of a fused QKV weight, or None for the families whose shards are not one piece of
    each sub-parameter (codegen interleaves, bigcode replicates the key/value block)."""
    kind, total, facts = fused_qkv_type(fused_module), weight_shape[0], model_facts()
    if kind == "bloom":
        return (total,)
    if kind in ("glm", "qwen"):
        if facts.num_kv_heads == 2 and facts.n_embd:
            kv = (total - facts.n_embd) // 2
            return (facts.n_embd, kv, kv)
        return (total // 3,) * 3
    if kind == "phi3":
        if not facts.num_attention_heads or facts.num_kv_heads is None:
            raise ValueError("fused_LinearLayer: a Phi-3 QKV split needs num_attention_heads and num_kv_heads "
                             "(deepspeed.module_inject.tp_shard.set_num_attention_heads / set_num_kv_heads)")
        kv = facts.num_kv_heads * (weight_shape[1] // facts.num_attention_heads)
        return (total - 2 * kv, kv, kv)
    return None


class fused_LinearLayer(LinearLayer):  # noqa: N801 - DeepSpeed's class name
    """A fused QKV projection cut per sub-parameter as its model family lays it out (``fused_module``: the
    block holding it). Interleaved families are recorded as unsupported by universal checkpoints and can only be
    kept whole (``skip_partition=True``) or one rank."""

    def __init__(self, module: nn.Module, mp_group: dist.ProcessGroup | None = None, skip_partition: bool = False,
                 *, fused_module: nn.Module, name: str | None = None, device: torch.device | None = None) -> None:
        if fused_module is None:
            raise ValueError("fused_LinearLayer: fused_module is required (the block holding the projection)")
        self._fused_sizes = fused_qkv_sizes(fused_module, tuple(module.weight.shape))
        self._fused_block = (fused_module,)  # in a tuple: not registered as a submodule (it holds this layer)
        if self._fused_sizes is None:
            self._unsupported_reason = _INTERLEAVED
        super().__init__(module, mp_group, name=name, device=device, skip_partition=skip_partition)
        self._set_qwen_split_size()

    def _freeze_partition_sizes(self, total_size: int) -> tuple[int, ...]:
        sizes = super()._freeze_partition_sizes(total_size)
        self._set_qwen_split_size()
        return sizes

    def _set_qwen_split_size(self) -> None:
        """QWen unpacks query, key and value from the fused output by ``attn.split_size``: this rank's query
        width, which must not be zero (the model's own split would then return one tensor)."""
        block = self._fused_block[0]
        if fused_qkv_type(block) != "qwen" or self._fused_sizes is None:
            return
        width = self._widths[0][self.tp_index]
        if width == 0:
            raise RuntimeError(f"AutoTP cannot shard this QWen attention over {self.tp_world_size} ranks: rank "
                               f"{self.tp_index} would hold an empty query/key/value shard; use a tensor-parallel "
                               "size that leaves every rank at least one query head")
        block.attn.split_size = width

    def _default_subparam_sizes(self, out_features: int) -> tuple[int, ...] | None:
        sizes = self._fused_sizes
        return sizes if sizes is not None and len(sizes) > 1 else None

    def _init_split(self, *args: Any) -> None:
        if self._unsupported_reason and self.tp_world_size > 1 and not args[4]:
            raise ValueError(f"fused_LinearLayer '{self.name}': {_INTERLEAVED}; this version does not cut that "
                             "layout over tensor-parallel ranks (build the model with autotp_shard instead)")
        super()._init_split(*args)


_YUAN = ("Yuan shared-QK tensor parallelism selects noncontiguous head groups that universal checkpoint "
         "conversion cannot currently describe")


class Yuan_LinearLayer(LinearLayer):  # noqa: N801 - DeepSpeed's class name
    """Yuan's column projection: kept whole or on one rank here; its universal-checkpoint metadata says why it
    cannot be converted, and gathering refuses."""

    _unsupported_reason = _YUAN

    def _init_split(self, *args: Any) -> None:
        if self.tp_world_size > 1 and not args[4]:
            raise ValueError(f"Yuan_LinearLayer '{self.name}': {_YUAN}; this version does not cut it over "
                             "tensor-parallel ranks")
        super()._init_split(*args)


class Yuan_LinearAllreduce(LinearAllreduce):  # noqa: N801 - DeepSpeed's class name
    """Yuan's row projection (see :class:`Yuan_LinearLayer`)."""

    _unsupported_reason = _YUAN

    def _init_split(self, *args: Any) -> None:
        if self.tp_world_size > 1 and not args[4]:
            raise ValueError(f"Yuan_LinearAllreduce '{self.name}': {_YUAN}; this version does not cut it over "
                             "tensor-parallel ranks")
        super()._init_split(*args)

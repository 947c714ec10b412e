"""Tensor-parallel replacements of ``nn.Linear`` / HF ``Conv1D`` / ``nn.Embedding`` (DeepSpeed's class names).

Each layer keeps only this rank's shard of its weight and records, per parameter, the dimension it is split
along and the :class:`ShardLayout` of that split, so shards can be gathered back into full tensors (checkpoints)
or cut from full tensors (loading). The collectives are autograd functions, so the layers train as well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_inference.autotp._comm import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from ds_inference.autotp.sharding import ShardLayout, ShardMeta, make_layout


def _weight_of(module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"cannot shard {type(module).__name__}: it has no weight tensor")
    return weight


def _layout_or_default(layout: ShardLayout | None, module: nn.Module, dim: int,
                       tp_group: dist.ProcessGroup | None) -> ShardLayout:
    """``layout``, or (a layer built by hand, as DeepSpeed's ``LinearLayer(module, mp_group)``) the split of
    DeepSpeed's ``get_shard_size_list`` without head counts: near-even, the larger shards first."""
    if layout is not None:
        return layout
    meta = ShardMeta(tp_size=dist.get_world_size(group=tp_group))
    return make_layout([_weight_of(module).shape[dim]], meta, by_heads=False)


class TensorParallel_Layer(nn.Module):  # noqa: N801 - DeepSpeed's class name
    """Base of the sharded layers: the group, this rank's index, and the split of every parameter."""

    def __init__(self, tp_group: dist.ProcessGroup | None, name: str | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_world_size = dist.get_world_size(group=tp_group)
        self.tp_index = dist.get_rank(group=tp_group)
        self.name = name
        self._tp_dims: dict[str, int | None] = {}
        self._tp_layouts: dict[str, ShardLayout] = {}

    def _register_shard(self, pname: str, source: torch.Tensor | None, dim: int | None,
                        layout: ShardLayout | None, device: torch.device | None) -> None:
        """Register ``pname`` as this rank's shard of ``source`` (``dim`` None: replicated copy)."""
        self._tp_dims[pname] = dim
        if source is None:
            self.register_parameter(pname, None)
            return
        data = source.detach() if dim is None else layout.take(source.detach(), self.tp_index, dim)
        if device is not None:
            data = data.to(device)
        if dim is not None:
            self._tp_layouts[pname] = layout
        param = nn.Parameter(data, requires_grad=source.requires_grad)
        # Megatron's marker: a sliced parameter (each rank holds a different part) counts in the gradient norm on
        # every tensor-parallel rank; replicated ones are counted once.
        param.tensor_model_parallel = dim is not None
        self.register_parameter(pname, param)

    def partition_dims(self) -> dict[str, int | None]:
        """Split dimension of each own parameter (None: replicated)."""
        return {name: dim for name, dim in self._tp_dims.items() if getattr(self, name) is not None}

    @torch.no_grad()
    def gather_params(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors of the own parameters; a collective over the group."""
        full = {}
        for name, dim in self.partition_dims().items():
            local = getattr(self, name).detach()
            full[name] = local.clone() if dim is None else self._tp_layouts[name].gather(local, dim, self.tp_group)
        return full

    @torch.no_grad()
    def load_full_param(self, name: str, full: torch.Tensor) -> None:
        """Copy this rank's shard of the full tensor ``full`` into parameter ``name``."""
        target = getattr(self, name)
        dim = self._tp_dims[name]
        shard = full if dim is None else self._tp_layouts[name].take(full, self.tp_index, dim)
        if shard.shape != target.shape:
            raise ValueError(f"{self.name}.{name}: full tensor {tuple(full.shape)} gives a shard of "
                             f"{tuple(shard.shape)}, this rank holds {tuple(target.shape)}")
        target.copy_(shard)

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n}={tuple(getattr(self, n).shape)}" for n in self.partition_dims())
        return f"name={self.name}, tp={self.tp_index}/{self.tp_world_size}, {shapes}"


class LinearLayer(TensorParallel_Layer):
    """Column-parallel linear: this rank computes its slice of the output features (input replicated).

    ``transposed`` is for HF ``Conv1D`` (weight stored ``[in, out]``); ``gather_output`` all-gathers the
    output so the next layer sees every feature (only for an unpacked output dimension).
    """

    transposed = False

    def __init__(self, module: nn.Module, tp_group: dist.ProcessGroup | None, layout: ShardLayout | None = None,
                 *, name: str | None = None, gather_output: bool = False,
                 device: torch.device | None = None) -> None:
        super().__init__(tp_group, name)
        out_dim = 1 if self.transposed else 0
        layout = _layout_or_default(layout, module, out_dim, tp_group)
        self._register_shard("weight", _weight_of(module), out_dim, layout, device)
        self._register_shard("bias", getattr(module, "bias", None), 0, layout, device)
        if gather_output and any(len(p) > 1 for p in layout.pieces):
            raise ValueError(f"{name}: gather_output needs an unpacked output dimension")
        self.gather_output = gather_output
        self.output_sizes = tuple(layout.sizes)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = copy_to_tp(hidden, self.tp_group)
        if self.transposed:
            out = hidden @ self.weight
            out = out + self.bias if self.bias is not None else out
        else:
            out = F.linear(hidden, self.weight, self.bias)
        return gather_from_tp(out, self.output_sizes, self.tp_group) if self.gather_output else out


class LinearAllreduce(TensorParallel_Layer):
    """Row-parallel linear: input features arrive sharded, partial outputs are summed over the group
    (the all-reduce), the bias is added once afterwards."""

    transposed = False

    def __init__(self, module: nn.Module, tp_group: dist.ProcessGroup | None, layout: ShardLayout | None = None,
                 *, name: str | None = None, device: torch.device | None = None) -> None:
        super().__init__(tp_group, name)
        in_dim = 0 if self.transposed else 1
        layout = _layout_or_default(layout, module, in_dim, tp_group)
        self._register_shard("weight", _weight_of(module), in_dim, layout, device)
        self._register_shard("bias", getattr(module, "bias", None), None, None, device)
        self.input_sizes = tuple(layout.sizes)

    def _partial(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight if self.transposed else F.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tp(self._partial(hidden), self.tp_group)
        return out + self.bias if self.bias is not None else out


class LmHeadLinearAllreduce(LinearAllreduce):
    """Output head split along the hidden dimension: the replicated input is sliced to this rank's features,
    the partial logits are summed over the group. Shares its shard with a tied :class:`HiddenParallelEmbedding`."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(scatter_to_tp(hidden, self.input_sizes, self.tp_group))


class conv_LinearLayer(LinearLayer):  # noqa: N801 - DeepSpeed's class name
    """Column-parallel HF ``Conv1D`` (weight ``[in, out]``)."""

    transposed = True


class Conv_LinearALlreduce(LinearAllreduce):  # noqa: N801 - DeepSpeed's class name (sic)
    """Row-parallel HF ``Conv1D`` (weight ``[in, out]``)."""

    transposed = True


class HiddenParallelEmbedding(TensorParallel_Layer):
    """Embedding split along the hidden dimension: each rank looks up its columns, the result is all-gathered."""

    def __init__(self, module: nn.Embedding, tp_group: dist.ProcessGroup | None, layout: ShardLayout, *,
                 name: str | None = None, device: torch.device | None = None) -> None:
        super().__init__(tp_group, name)
        self._register_shard("weight", _weight_of(module), 1, layout, device)
        self.padding_idx = module.padding_idx
        self.max_norm, self.norm_type = module.max_norm, module.norm_type
        self.scale_grad_by_freq, self.sparse = module.scale_grad_by_freq, module.sparse
        self.num_embeddings = module.num_embeddings
        self.embedding_dim = module.embedding_dim
        self.output_sizes = tuple(layout.sizes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                            self.scale_grad_by_freq, self.sparse)
        return gather_from_tp(local, self.output_sizes, self.tp_group)


class VocabParallelEmbedding(TensorParallel_Layer):
    """Embedding split along the vocabulary (Hugging Face's ``embedding_rowwise``), sharing its shard with the
    tied output head ``head`` (a column-parallel :class:`LinearLayer` over the same weight): each rank looks up the
    ids of its rows, zeros the others, and the partial embeddings are summed over the group."""

    def __init__(self, module: nn.Embedding, head: LinearLayer, *, name: str | None = None) -> None:
        super().__init__(head.tp_group, name)
        if head.weight.shape[1] != module.embedding_dim or sum(head.output_sizes) != module.num_embeddings:
            raise ValueError(f"{name}: the tied head's shard {tuple(head.weight.shape)} does not come from this "
                             f"embedding ({module.num_embeddings} x {module.embedding_dim})")
        self.weight = head.weight  # one shard, trained through both layers
        self._tp_dims["weight"] = 0
        self._tp_layouts["weight"] = head._tp_layouts["weight"]
        sizes = head.output_sizes
        self.vocab_start_index = sum(sizes[:self.tp_index])
        self.vocab_end_index = self.vocab_start_index + sizes[self.tp_index]
        pad = module.padding_idx
        self.padding_idx = pad - self.vocab_start_index if pad is not None and (
            self.vocab_start_index <= pad < self.vocab_end_index) else None
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = F.embedding((ids - self.vocab_start_index).masked_fill(outside, 0), self.weight, self.padding_idx)
        return reduce_from_tp(local.masked_fill(outside.unsqueeze(-1), 0.0), self.tp_group)


class EmbeddingLayer(nn.Module):
    """A plain (replicated) embedding built from a weight tensor, as DeepSpeed's ``EmbeddingLayer``."""

    def __init__(self, weight_shape: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight is None:
            if weight_shape is None:
                raise ValueError("EmbeddingLayer needs weight_shape or weight")
            weight = torch.empty(weight_shape, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Normalize(nn.Module):
    """LayerNorm over the last dimension built from given weights, as DeepSpeed's ``Normalize``."""

    def __init__(self, dim: int | None = None, dtype: torch.dtype = torch.float32, eps: float = 1e-5,
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight is None:
            if dim is None:
                raise ValueError("Normalize needs dim or weight")
            weight = torch.ones(dim, dtype=dtype)
        self.norm = nn.LayerNorm(weight.shape[-1], eps=eps, dtype=weight.dtype)
        with torch.no_grad():
            self.norm.weight.copy_(weight)
            if bias is not None:
                self.norm.bias.copy_(bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

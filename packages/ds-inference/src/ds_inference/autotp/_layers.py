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
from ds_inference.autotp._linear_split import LinearSplitMixin, group_size_and_rank
from ds_inference.autotp.sharding import ShardLayout
from ds_inference.autotp.split_rules import layout_widths
from ds_inference.autotp.subparam_spec import SubParamView
from ds_inference.autotp.uc_meta import set_uc_meta

# a sub-parameter layer's view and split dimension (see _subparam_layers)
SubParams = tuple[SubParamView, int]


def _weight_of(module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"cannot shard {type(module).__name__}: it has no weight tensor")
    return weight


def _one_group(tp_group: dist.ProcessGroup | None, mp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group given positionally (``tp_group``) or as DeepSpeed's keyword ``mp_group``."""
    if tp_group is not None and mp_group is not None and tp_group is not mp_group:
        raise ValueError("give the tensor-parallel group once: tp_group (positional) or mp_group, not both")
    return tp_group if tp_group is not None else mp_group


class TensorParallel_Layer(nn.Module):  # noqa: N801 - DeepSpeed's class name
    """Base of the sharded layers: the group, this rank's index, and the split of every parameter.

    ``defer_collectives_to_compiler`` (set by DeepCompile's ``autotp`` pass): the linear layers skip their f/g
    collectives, which the compiled graph then carries; ``tp_overlap_comm`` is DeepSpeed's flag (not used here).
    """

    defer_collectives_to_compiler = False
    tp_overlap_comm = False

    def __init__(self, tp_group: dist.ProcessGroup | None, name: str | None = None) -> None:
        super().__init__()
        self.tp_group = self.mp_group = tp_group  # mp_group: DeepSpeed's attribute name
        # no group and no torch.distributed: one rank, no collectives (a layer built to describe a split)
        self._collective, self.tp_world_size, self.tp_index = group_size_and_rank(tp_group)
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
        if dim is not None:
            self._publish_tp_hooks(param)
        self.register_parameter(pname, param)

    def partition_dims(self) -> dict[str, int | None]:
        """Split dimension of each own parameter (None: replicated)."""
        return {name: dim for name, dim in self._tp_dims.items() if getattr(self, name) is not None}

    def _publish_tp_hooks(self, param: nn.Parameter) -> None:
        """DeepSpeed's per-parameter hooks on a sliced parameter: ``param.gather_params([param])`` makes its data
        the full tensor, ``param._tp_partition([param])`` cuts it back to this rank's shard (ZeRO-3 and
        ``GatherReplacedLayerParams`` call them); ``ds_is_replaced_module`` marks it as AutoTP's."""
        param.gather_params = self.gather_params
        param._tp_partition = self._tp_partition
        param.ds_is_replaced_module = True

    def _pname(self, param: torch.Tensor) -> str:
        for name in self._tp_dims:
            if getattr(self, name, None) is param:
                return name
        raise ValueError(f"{self.name}: the given parameter {tuple(param.shape)} is not one of this layer's "
                         f"({sorted(self._tp_dims)})")

    def _full(self, param: torch.Tensor) -> torch.Tensor:
        pname = self._pname(param)
        dim, local = self._tp_dims[pname], param.detach()
        if dim is None or not self._collective or self.tp_world_size == 1:
            return local.clone()
        return self._tp_layouts[pname].gather(local, dim, self.tp_group)

    @torch.no_grad()
    def gather_params(self, params_list: list[torch.Tensor | None] | None = None) -> dict[str, torch.Tensor] | None:
        """``params_list`` given (DeepSpeed): replace each parameter's data by the full tensor, in place.
        Without it: the full tensors of the own parameters by name. A collective over the group."""
        if params_list is None:
            return {name: self._full(getattr(self, name)) for name in self.partition_dims()}
        for param in params_list:
            if param is not None:
                param.data = self._full(param).contiguous()
        return None

    @torch.no_grad()
    def _tp_partition(self, params_list: list[torch.Tensor | None]) -> None:
        """Cut each given full parameter to this rank's shard, in place (one already cut is left as it is)."""
        for param in params_list:
            if param is None:
                continue
            pname = self._pname(param)
            dim = self._tp_dims[pname]
            if dim is not None and param.shape[dim] == self._tp_layouts[pname].full:
                param.data = self._tp_layouts[pname].take(param.data, self.tp_index, dim)

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

    def _mark_uc_metadata(self) -> None:
        """Describe each own parameter for universal checkpoints (DeepSpeed's format) from its layout: a plain
        split by per-rank sizes, a packed one by sub-parameters, anything else as unsupported; split along
        dim 1 is row-parallel. The linear layers override this with their DeepSpeed-specific description."""
        for pname, dim in self.partition_dims().items():
            param = getattr(self, pname)
            local = tuple(param.shape)
            if dim is None:
                set_uc_meta(param, partition_type="row", logical_shape=local, output_shape=local,
                            original_shape=local, replicated=True)
                continue
            layout = self._tp_layouts[pname]
            full = tuple(layout.full if i == dim else n for i, n in enumerate(local))
            found, fields = layout_widths(layout), {}
            if found is None:
                fields["unsupported_reason"] = f"{self.name}.{pname} is split in pieces {layout.pieces}"
            elif len(found[0]) == 1:
                fields["partition_sizes"] = tuple(layout.sizes)
            else:
                fields.update(sub_param_shape=tuple(found[0] if i == dim else n for i, n in enumerate(full)),
                              sub_param_sizes=found[0], sub_param_shard_widths=found[1])
            set_uc_meta(param, partition_type="row" if dim == 1 else "column", partition_dim=dim,
                        logical_shape=full, output_shape=full[:1], target_partition_shape=local, original_shape=full,
                        **fields)

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n}={tuple(getattr(self, n).shape)}" for n in self.partition_dims())
        return f"name={self.name}, tp={self.tp_index}/{self.tp_world_size}, {shapes}"


class LinearLayer(LinearSplitMixin, TensorParallel_Layer):
    """Column-parallel linear: this rank computes its slice of the output features (input replicated).

    ``layout`` (from :func:`autotp_shard`) says how the output features are cut; without it (a layer built by
    hand with DeepSpeed's arguments ``(module, mp_group, name=...)``) the split rule of
    :mod:`ds_inference.autotp.split_rules` decides. ``transposed`` is for HF ``Conv1D`` (weight stored
    ``[in, out]``); ``gather_output`` all-gathers the output so the next layer sees every feature (only for an
    unpacked output dimension); ``skip_partition`` keeps the module's full tensors (their split still recorded).
    """

    transposed = False

    def __init__(self, module: nn.Module, tp_group: dist.ProcessGroup | None = None,
                 layout: ShardLayout | None = None, *, name: str | None = None, gather_output: bool = False,
                 device: torch.device | None = None, mp_group: dist.ProcessGroup | None = None,
                 skip_partition: bool = False, _subparams: SubParams | None = None) -> None:
        super().__init__(_one_group(tp_group, mp_group), name)
        view, dim = _subparams if _subparams is not None else (None, None)
        self._init_split(module, layout, view, dim, skip_partition, device)
        if gather_output and len(self._sizes()) > 1:
            raise ValueError(f"{name}: gather_output needs an unpacked output dimension")
        self.gather_output = gather_output
        self._mark_uc_metadata()

    @property
    def output_sizes(self) -> tuple[int, ...]:
        return tuple(self._tp_layouts["weight"].sizes)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._collective and not self.defer_collectives_to_compiler:
            hidden = copy_to_tp(hidden, self.tp_group)
        if self.transposed:
            out = hidden @ self.weight
            out = out + self.bias if self.bias is not None else out
        else:
            out = F.linear(hidden, self.weight, self.bias)
        if self.gather_output and self._collective:
            if self.defer_collectives_to_compiler:  # an op the graph can hold (defined by deepspeed.compile)
                return torch.ops.autotp.gather_from_tp_region(out, list(self.output_sizes))
            return gather_from_tp(out, self.output_sizes, self.tp_group)
        return out


class LinearAllreduce(LinearSplitMixin, TensorParallel_Layer):
    """Row-parallel linear: input features arrive sharded, partial outputs are summed over the group
    (the all-reduce), the bias is added once afterwards. Arguments as :class:`LinearLayer`'s."""

    transposed = False
    _row = True

    def __init__(self, module: nn.Module, tp_group: dist.ProcessGroup | None = None,
                 layout: ShardLayout | None = None, *, name: str | None = None, device: torch.device | None = None,
                 mp_group: dist.ProcessGroup | None = None, skip_partition: bool = False,
                 _subparams: SubParams | None = None) -> None:
        super().__init__(_one_group(tp_group, mp_group), name)
        view, dim = _subparams if _subparams is not None else (None, None)
        self._init_split(module, layout, view, dim, skip_partition, device)
        self._mark_uc_metadata()

    @property
    def input_sizes(self) -> tuple[int, ...]:
        return tuple(self._tp_layouts["weight"].sizes)

    def _partial(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight if self.transposed else F.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self._partial(hidden)
        if self._collective and not self.defer_collectives_to_compiler:
            out = reduce_from_tp(out, self.tp_group)
        return out + self.bias if self.bias is not None else out


class LmHeadLinearAllreduce(LinearAllreduce):
    """Output head split along the hidden dimension: the replicated input is sliced to this rank's features
    (by the split frozen at construction), the partial logits are summed over the group. Shares its shard with a
    tied :class:`HiddenParallelEmbedding`; never the source module's tensors (named ``lm_head`` by default)."""

    _decouple_source = True

    def __init__(self, module: nn.Module, tp_group: dist.ProcessGroup | None = None,
                 layout: ShardLayout | None = None, *, name: str | None = "lm_head", **kwargs) -> None:
        super().__init__(module, tp_group, layout, name=name, **kwargs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sizes = self.input_sizes
        if hidden.shape[-1] != sum(sizes):
            raise ValueError(f"{self.name}: input of {hidden.shape[-1]} features; this head was split for "
                             f"{sum(sizes)}")
        if self._collective:
            return super().forward(scatter_to_tp(hidden, sizes, self.tp_group))
        local = hidden.narrow(-1, sum(sizes[:self.tp_index]), sizes[self.tp_index])
        out = self._partial(local)
        return out + self.bias if self.bias is not None else out


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
        self._mark_uc_metadata()

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

    def _mark_uc_metadata(self) -> None:
        """Nothing of its own: the weight is the tied head's, which describes it."""

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

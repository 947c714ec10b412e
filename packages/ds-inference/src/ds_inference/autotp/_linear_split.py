"""The split state of a sharded linear layer, kept in DeepSpeed's terms so hand-built layers and their
universal-checkpoint description follow DeepSpeed's rules.

A layer's weight is seen through a logical view (``_logical_shape``, ``[out, in]`` for a plain layer, the
``shape=`` spec of a sub-parameter layer) split along ``partition_dim`` into sub-parameters
(``_subparam_sizes``; None: one block), rank ``r`` holding ``_widths[i][r]`` of sub-parameter ``i``. The physical
:class:`ShardLayout` of the weight and of the bias (cut along the bias's own view, or replicated) is derived from
that state by :meth:`_rebuild_layouts`, so changing the widths or refreezing the split re-derives every layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ds_inference.autotp.sharding import ShardLayout
from ds_inference.autotp.split_rules import check_widths, layout_widths, logical_layout, subparam_widths
from ds_inference.autotp.subparam_spec import SubParamView
from ds_inference.autotp.uc_meta import set_uc_meta, shape_before_zero3


class LinearSplitMixin:
    """Split state and DeepSpeed's partition/gather/metadata methods of ``LinearLayer`` and ``LinearAllreduce``
    (and their sub-parameter variants). Expects ``tp_world_size``, ``tp_index``, ``tp_group``, ``name``,
    ``_collective``, ``_tp_dims``, ``_tp_layouts`` and ``transposed`` from the layer."""

    _row = False  # row-parallel: the input features are split, the bias is replicated
    _unsupported_reason: str | None = None  # a layout universal checkpoints cannot describe, and why
    _decouple_source = False  # never share the source module's tensors (an output head tied to an embedding)

    def _split_name(self) -> object:
        return self.name

    def _default_subparam_sizes(self, out_features: int) -> tuple[int, ...] | None:
        return None

    def _init_split(self, module: nn.Module, layout: ShardLayout | None, view: SubParamView | None,
                    partition_dim: int | None, skip_partition: bool, device: torch.device | None) -> None:
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"cannot shard {type(module).__name__}: it has no weight tensor")
        self._orig_weight_shape = shape_before_zero3(weight)
        self._orig_bias_shape = shape_before_zero3(bias)
        if view is not None:
            self._logical_shape, self._output_shape = view.logical, view.output
            self.partition_dim, self._subparam_sizes = partition_dim, view.sizes
            self._bias_dim = None if self._row else view.bias_dim
            widths = subparam_widths(self._sizes(), self.tp_world_size, self._split_name())
        else:
            if len(self._orig_weight_shape) != 2:
                raise ValueError(f"{self.name}: a weight of shape {self._orig_weight_shape}; accepted: 2-D")
            out_in = self._orig_weight_shape[::-1] if self.transposed else self._orig_weight_shape
            self._logical_shape, self._output_shape = tuple(out_in), (out_in[0],)
            self.partition_dim, self._bias_dim = (1, None) if self._row else (0, 0)
            if layout is None:
                self._subparam_sizes = self._default_subparam_sizes(out_in[0])
                widths = subparam_widths(self._sizes(), self.tp_world_size, self._split_name())
            else:
                found = layout_widths(layout)
                if found is None:
                    raise ValueError(f"{self.name}: the given layout {layout.pieces} does not hold one piece of "
                                     "each sub-parameter per rank in rank order")
                sizes, widths = found
                self._subparam_sizes = sizes if len(sizes) > 1 else None
        self._widths = [list(w) for w in widths]
        self._rebuild_layouts()
        partition = self.tp_world_size > 1 and not skip_partition
        self._register(weight, "weight", partition, device)
        self._register(bias, "bias", partition, device)

    def _sizes(self) -> tuple[int, ...]:
        sizes = self._subparam_sizes
        return tuple(sizes) if sizes is not None else (self._logical_shape[self.partition_dim],)

    def _rebuild_layouts(self) -> None:
        sizes, widths = self._sizes(), self._widths
        check_widths(sizes, widths, self.tp_world_size, f"AutoTP layer '{self.name}'")
        shape = self._logical_shape
        dim, layout = logical_layout(shape, len(shape) - 1, self.partition_dim, sizes, widths)
        self._tp_dims["weight"], self._tp_layouts["weight"] = (1 - dim if self.transposed else dim), layout
        self._tp_dims["bias"] = None if self._bias_dim is None else 0
        self._tp_layouts.pop("bias", None)
        if self._bias_dim is not None:
            out = self._output_shape
            self._tp_layouts["bias"] = logical_layout(out, len(out), self._bias_dim, sizes, widths)[1]

    def _register(self, source: torch.Tensor | None, pname: str, partition: bool,
                  device: torch.device | None) -> None:
        if source is None:
            self.register_parameter(pname, None)
            return
        dim = self._tp_dims[pname]
        if partition and dim is not None:
            param = nn.Parameter(self._tp_layouts[pname].take(source.detach(), self.tp_index, dim),
                                 requires_grad=source.requires_grad)
        elif isinstance(source, nn.Parameter) and device is None and not self._decouple_source:
            param = source  # nothing to cut (one rank, or skip_partition): the module's own parameter
        else:
            param = nn.Parameter(source.detach().clone(), requires_grad=source.requires_grad)
        if device is not None:
            param.data = param.data.to(device)
        # Megatron's marker: a sliced parameter counts in the gradient norm on every tensor-parallel rank
        param.tensor_model_parallel = dim is not None
        if dim is not None:
            self._publish_tp_hooks(param)
        self.register_parameter(pname, param)

    # ---- DeepSpeed's per-layer methods
    @property
    def _partition_sizes(self) -> tuple[int, ...]:
        """Per-rank width of the split dimension (all sub-parameters together)."""
        return tuple(sum(w[r] for w in self._widths) for r in range(self.tp_world_size))

    @property
    def _subparam_shard_widths(self) -> list[list[int]]:
        return [list(w) for w in self._widths]

    @_subparam_shard_widths.setter
    def _subparam_shard_widths(self, widths: list[list[int]]) -> None:
        previous, self._widths = self._widths, [list(w) for w in widths]
        try:
            self._rebuild_layouts()
        except ValueError:
            self._widths = previous
            raise

    def _freeze_partition_sizes(self, total_size: int) -> tuple[int, ...]:
        """Re-derive the split for the current ``tp_world_size`` from the split rule (and the model facts it
        reads now); later partitions, gathers and metadata use it. Returns the per-rank widths."""
        if int(total_size) != sum(self._sizes()):
            raise ValueError(f"_freeze_partition_sizes: total_size={total_size}; accepted: {sum(self._sizes())}, "
                             f"the width of dimension {self.partition_dim} of '{self.name}'")
        self._subparam_shard_widths = subparam_widths(self._sizes(), self.tp_world_size, self._split_name())
        return self._partition_sizes

    @torch.no_grad()
    def _tp_partition(self, params_list: list[torch.Tensor | None]) -> None:
        """Cut each given full parameter to this rank's shard, in place."""
        if self._unsupported_reason and self.tp_world_size > 1:
            raise RuntimeError(self._unsupported_reason)
        super()._tp_partition(params_list)

    @torch.no_grad()
    def gather_params(self, params_list: list[torch.Tensor | None] | None = None) -> dict[str, torch.Tensor] | None:
        """As the base layer's (in place with ``params_list``, else full tensors by name)."""
        if self._unsupported_reason:
            raise RuntimeError(self._unsupported_reason)
        return super().gather_params(params_list)

    def _mark_uc_metadata(self) -> None:
        """Attach the universal-checkpoint description (DeepSpeed's format) to the weight and the bias."""
        kind = "row" if self._row else "column"
        reason = self._unsupported_reason
        weight, bias = self.weight, getattr(self, "bias", None)
        logical, dim = self._logical_shape, self.partition_dim
        if self.transposed:  # a plain [in, out] weight: described as stored
            logical, dim = self._orig_weight_shape, self._tp_dims["weight"]
        common = {"partition_type": kind, "original_shape": self._orig_weight_shape}
        if reason:
            set_uc_meta(weight, partition_dim=dim, logical_shape=logical, unsupported_reason=reason, **common)
        else:
            set_uc_meta(weight, partition_dim=dim, logical_shape=logical, output_shape=self._output_shape,
                        target_partition_shape=tuple(weight.shape), **common, **self._split_fields(False))
        if bias is None:
            return
        out, bdim = self._output_shape, self._bias_dim
        common = {"partition_type": kind, "original_shape": self._orig_bias_shape, "is_bias": True}
        if reason:
            set_uc_meta(bias, partition_dim=bdim, logical_shape=out, unsupported_reason=reason, **common)
        elif bdim is None:
            set_uc_meta(bias, logical_shape=self._orig_bias_shape, output_shape=self._orig_bias_shape,
                        target_partition_shape=tuple(bias.shape), replicated=True, **common)
        else:
            set_uc_meta(bias, partition_dim=bdim, logical_shape=out, output_shape=out,
                        target_partition_shape=tuple(bias.shape), **common, **self._split_fields(True))

    def _subparam_spec(self, bias: bool) -> tuple | None:
        """The view spec published for a fused parameter: its logical shape with the sub-parameter sizes at
        the split dimension."""
        shape, dim = (self._output_shape, self._bias_dim) if bias else (self._logical_shape, self.partition_dim)
        return tuple(self._sizes() if i == dim else d for i, d in enumerate(shape))

    def _split_fields(self, bias: bool) -> dict:
        if self._subparam_sizes is None:
            return {"partition_sizes": self._partition_sizes}
        return {"sub_param_shape": self._subparam_spec(bias), "sub_param_sizes": self._sizes(),
                "sub_param_shard_widths": self._subparam_shard_widths}


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[bool, int, int]:
    """(collective, world size, rank) of a layer's group: no group outside ``torch.distributed`` is one rank
    without collectives (DeepSpeed's ``mp_group=None``); inside, ``None`` is the default group."""
    if group is None and not dist.is_initialized():
        return False, 1, 0
    return True, dist.get_world_size(group=group), dist.get_rank(group=group)

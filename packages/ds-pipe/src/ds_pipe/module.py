"""``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` (DeepSpeed's ``deepspeed.runtime.pipe.module``).

A ``PipelineModule`` is a sequence of layers split into stages; each rank builds only the layers of its own stage
(``LayerSpec``s are built lazily, so the other stages' layers never exist on it). The split is DeepSpeed's
arithmetic: ``partition_uniform`` / ``partition_balanced`` give a ``parts`` list of ``num_stages + 1`` layer
boundaries, stage ``s`` owning layers ``parts[s]:parts[s + 1]``.
"""

from __future__ import annotations

import glob
import logging
import os
import random
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from ds_pipe.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology

logger = logging.getLogger(__name__)

_GPT_PIPE_MODELS = ("GPTModelPipe", "GPT2ModelPipe")


class PipelineError(Exception):
    """Errors related to the use of ``PipelineModule`` (DeepSpeed's name)."""


def checkpoint(function: Callable, *args: Any) -> Any:
    """The default ``activation_checkpoint_func``: ``torch.utils.checkpoint.checkpoint``, non-reentrant, so layers
    whose inputs do not require grad (the first stage's) still get their parameter gradients."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint


# ---------------------------------------------------------------- DeepSpeed's partitioning arithmetic

def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's ``ds_utils.partition_uniform``: ``num_parts + 1`` boundaries, the first ``num_items %
    num_parts`` parts one item larger (``partition_uniform(10, 4) == [0, 3, 6, 8, 10]``)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunksize, residual = divmod(num_items, num_parts)
    return [p * chunksize + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``ds_utils.partition_balanced``: the linear-partition dynamic program minimising, prefix by
    prefix, the spread (heaviest minus lightest part), ties going to the later split point, as DeepSpeed's."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + float(w)
    dp_max[0][0] = 0.0
    dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], part)
                min_sum = min(dp_min[k][j - 1], part)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    parts.reverse()
    return parts


def set_random_seed(seed: int) -> None:
    """Seed python, numpy (when installed) and torch, as DeepSpeed's ``ds_utils.set_random_seed``."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional for ds-pipe
        pass
    else:
        numpy.random.seed(seed)
    # torch.manual_seed also queues lazy seeds for every uninitialised device type, each capturing a stack trace
    # (~0.1-0.5 ms per call: 20-30% of a CPU pipeline step with seed_layers); seed the CPU generator and only the
    # accelerators that exist
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# ---------------------------------------------------------------- layer specifications

class LayerSpec:
    """Building block for specifying pipeline-parallel modules: the type of a layer and its constructor
    arguments, built only on the rank that owns it (``LayerSpec(torch.nn.Linear, 4, 8, bias=False)``)."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: typename must be a torch.nn.Module subclass, got {typename!r}; wrap "
                            "functions in a module or pass them to PipelineModule directly")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """Build the stored specification."""
        if log:
            logger.info("RANK=%s building %r", self.global_rank, self)
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (``tied_weight_attr``, dotted names allowed) are shared by every layer with the same
    ``key``, across stages: one module per rank, gradients all-reduced between the stages that own it."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = ["weight"], **module_kwargs: Any) -> None:  # noqa: B006
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _layer_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return layer.__class__.__name__
    return getattr(layer, "__name__", None)


def _trainable_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _count_spec_params(spec: LayerSpec) -> int:
    """Trainable parameters of a spec, built on the meta device (no memory, no real init) where it can be."""
    try:
        with torch.device("meta"):
            return _trainable_numel(spec.build())
    except Exception:  # noqa: BLE001 - a constructor that cannot run on meta is built for real, as DeepSpeed does
        return _trainable_numel(spec.build())


def _recursive_getattr(module: nn.Module, attr_name: str) -> Any:
    """``linear.weight`` -> ``module.linear.weight``."""
    value: Any = module
    for item in attr_name.split("."):
        value = getattr(value, item)
    return value


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _resolve_topology(num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
    """The topology a PipelineModule runs on, checked against the world size (1 without a process group)."""
    world = dist.get_world_size() if _distributed() else 1
    where = f"the world size ({world})" if _distributed() else "1 process (no torch.distributed process group)"
    if num_stages is None and topology is None:
        raise ValueError("PipelineModule: pass num_stages or topology (both are None)")
    if topology is not None:
        if not isinstance(topology, ProcessTopology):
            raise TypeError(f"PipelineModule: topology must be a ProcessTopology, got {type(topology).__name__}")
        if "pipe" not in topology.get_axis_names():
            raise ValueError(f"PipelineModule: topology {topology!r} has no 'pipe' axis")
        if num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise ValueError(f"PipelineModule: num_stages={num_stages} disagrees with the topology's pipe dimension "
                             f"({topology.get_dim('pipe')}); pass one of them")
        if topology.world_size() != world:
            raise ValueError(f"PipelineModule: topology {topology!r} has {topology.world_size()} ranks but runs on "
                             f"{where}: the product of its dims must be the world size")
        return topology
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"PipelineModule: num_stages must be a positive int, got {num_stages!r}")
    if world % num_stages:
        raise ValueError(f"PipelineModule: num_stages={num_stages} must divide {where}")
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)


def _check_options(activation_checkpoint_interval: Any, checkpointable_layers: Any) -> None:
    interval = activation_checkpoint_interval
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(f"PipelineModule: activation_checkpoint_interval must be an int >= 0, got {interval!r}")
    if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
        raise TypeError("PipelineModule: checkpointable_layers must be a list of layer class names, got "
                        f"{type(checkpointable_layers).__name__}")


class PipelineModule(nn.Module):
    """Modules to be parallelized with pipeline parallelism: ``layers`` (``LayerSpec``, ``TiedLayerSpec``,
    ``nn.Module``s or callables, or an ``nn.Sequential``) run one after the other, split into ``num_stages``
    stages (or the ``pipe`` axis of ``topology``); this rank builds and runs only its stage's layers."""

    def __init__(self, layers: Any, num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: Any = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = checkpoint, checkpointable_layers: list[str] | None = None,
                 dynamic_shape: bool = False) -> None:
        super().__init__()
        _check_options(activation_checkpoint_interval, checkpointable_layers)
        self.micro_offset = 0
        self.loss_fn = loss_fn
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers = seed_layers
        self.partition_method = partition_method
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self._topo = _resolve_topology(num_stages, topology)
        self.num_stages = self._topo.get_dim("pipe")
        self.global_rank = dist.get_rank() if _distributed() else 0
        self.world_size = self._topo.world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.stage_id = self._topo.get_coord(self.global_rank).pipe
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        if self._num_layers < self.num_stages:
            raise ValueError(f"PipelineModule: more stages (num_stages={self.num_stages}) than layers "
                             f"({self._num_layers}); every stage needs at least one layer")
        self._local_start, self._local_stop = 0, None
        self._partition_layers(method=partition_method)
        # groups are created only after every check that could fail on some ranks has passed on all of them
        self._grid = PipelineParallelGrid(topology=self._topo) if _distributed() else None
        self.forward_funcs: list[Callable] = []
        self.fwd_map: dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.is_checkpointable_results: list[bool] = []
        self.is_checkpointable_results_interval: int | None = None
        self._build()
        device = self._device()
        if device is not None:
            self.to(device)
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()
        self.dynamic_shape = dynamic_shape

    def _device(self) -> torch.device | None:
        """Where the stage lives: this rank's GPU under NCCL, else where its layers were built."""
        if _distributed() and dist.get_backend() == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return None

    # ------------------------------------------------------------ partitioning

    def _partition_layers(self, method: Any = "uniform") -> None:
        self.parts = self._compute_parts(method)
        if self.global_rank == 0:
            logger.info("Partitioning pipeline stages with method %s: parts=%s", method, self.parts)
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def _compute_parts(self, method: Any) -> list[int]:
        num_stages = self.num_stages
        if isinstance(method, (list, tuple)):
            return self._explicit_parts(method, method)
        if not isinstance(method, str):
            raise TypeError(f"PipelineModule: partition_method must be a str or a list of layer boundaries, got "
                            f"{type(method).__name__}")
        lowered = method.lower()
        if lowered == "uniform":
            return partition_uniform(num_items=self._num_layers, num_parts=num_stages)
        if lowered == "parameters":
            return partition_balanced(weights=self._count_layer_params(), num_parts=num_stages)
        if lowered.startswith("type:"):
            weights = [0] * self._num_layers
            for idx in self._find_layer_type(lowered.split(":", 1)[1]):
                weights[idx] = 1
            return partition_balanced(weights=weights, num_parts=num_stages)
        if re.fullmatch(r"\s*\d+(\s*,\s*\d+)+\s*", lowered):
            return self._explicit_parts([int(p) for p in lowered.split(",")], method)
        raise ValueError(f"PipelineModule: partition_method={method!r} is not one of 'parameters', 'uniform', "
                         "'type:<regex>' or explicit boundaries (a list like [0, 3, 8] or '0,3,8')")

    def _explicit_parts(self, parts: Sequence[Any], method: Any) -> list[int]:
        """Boundaries given by the user: ``num_stages + 1`` ints from 0 to the number of layers, increasing."""
        ok = (len(parts) == self.num_stages + 1 and all(isinstance(p, int) and not isinstance(p, bool) for p in parts)
              and parts[0] == 0 and parts[-1] == self._num_layers
              and all(a < b for a, b in zip(parts, parts[1:], strict=False)))
        if not ok:
            raise ValueError(f"PipelineModule: partition_method={method!r}: explicit boundaries must be "
                             f"{self.num_stages + 1} increasing ints from 0 to {self._num_layers} (the number of "
                             "layers), one more than num_stages")
        return list(parts)

    def _count_layer_params(self) -> list[int]:
        """Trainable parameters of each layer (specs are built one at a time, on the meta device)."""
        counts = [0] * self._num_layers
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, LayerSpec):
                counts[idx] = _count_spec_params(layer)
            elif isinstance(layer, nn.Module):
                counts[idx] = _trainable_numel(layer)
        return counts

    def _find_layer_type(self, layername: str) -> list[int]:
        typeregex = re.compile(layername, re.IGNORECASE)
        idxs = [idx for idx, layer in enumerate(self._layer_specs)
                if (name := _layer_name(layer)) is not None and typeregex.search(name)]
        if not idxs:
            raise ValueError(f"PipelineModule: partition_method 'type:{layername}' matches no layer class name "
                             f"(layers: {[_layer_name(layer) for layer in self._layer_specs]})")
        return idxs

    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"stage_owner(): layer_idx={layer_idx} is out of range (0..{self._num_layers - 1})")
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise PipelineError(f"Layer {layer_idx} not owned? parts={self.parts}")

    def _set_bounds(self, start: int | None = None, stop: int | None = None) -> None:
        """The slice of layers built on this process (``None``, ``None``: all of them)."""
        self._local_start = start
        self._local_stop = stop

    # ------------------------------------------------------------ building

    def _build(self) -> None:
        for local_idx, layer in enumerate(self._layer_specs[self._local_start:self._local_stop]):
            layer_idx = local_idx + self._local_start
            if self.seed_layers:
                (self.seed_fn or set_random_seed)(self.base_seed + layer_idx)
            if isinstance(layer, PipelineModule):
                raise TypeError(f"PipelineModule: layer {layer_idx} is itself a PipelineModule; nesting is not "
                                "supported, pass its layers instead")
            if isinstance(layer, nn.Module):
                self._add_layer(str(layer_idx), layer)
            elif isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, LayerSpec):
                self._add_layer(str(layer_idx), layer.build())
            elif callable(layer):
                self.forward_funcs.append(layer)
            else:
                raise TypeError(f"PipelineModule: layer {layer_idx} is a {type(layer).__name__}, not a LayerSpec, "
                                "nn.Module or callable")
        for p in self.parameters():  # all pipeline parameters are model parallel in the eyes of the optimizer
            p.ds_pipe_replicated = False

    def _add_layer(self, name: str, module: nn.Module) -> None:
        self.forward_funcs.append(module)
        self.fwd_map[name] = len(self.forward_funcs) - 1
        self.add_module(name, module)

    def _get_frozen_parameter_names(self, layer: Any) -> list[str]:
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            return [n for n, p in layer.named_parameters() if not p.requires_grad]
        return []

    # ------------------------------------------------------------ forward and activation checkpointing

    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers; every ``activation_checkpoint_interval`` layers that are checkpointable run
        under ``activation_checkpoint_func`` (a tuple output is passed on as the next chunk's arguments)."""
        self.micro_offset += 1
        num_layers = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._exec_range_func(0, num_layers)(forward_input)
        self._precompute_checkpointable_values()
        x = forward_input
        starts = range(0, num_layers, interval)
        for start_idx, checkpointable in zip(starts, self.is_checkpointable_results, strict=True):
            end_idx = min(start_idx + interval, num_layers)
            if not isinstance(x, tuple):
                x = (x,)
            func = self._exec_range_func(start_idx, end_idx)
            x = self.activation_checkpoint_func(func, *x) if checkpointable else func(*x)
        return x

    def _exec_range_func(self, start: int, end: int) -> Callable:
        """Layers ``start:end`` of this stage as one function (seeded per layer and micro-batch with
        ``seed_layers``, the seed captured now so a recomputation sees the same one)."""
        local_micro_offset = self.micro_offset + 1

        def exec_func(*inputs: Any) -> Any:
            if len(inputs) == 1:  # a single tensor travels unwrapped
                inputs = inputs[0]
            for idx, layer in enumerate(self.forward_funcs[start:end]):
                self.curr_layer = start + idx + self._local_start
                if self.seed_layers:
                    (self.seed_fn or set_random_seed)(self.base_seed * local_micro_offset + self.curr_layer)
                inputs = layer(inputs)
            return inputs

        return exec_func

    def _precompute_checkpointable_values(self) -> None:
        interval = self.activation_checkpoint_interval
        num_layers = len(self.forward_funcs)
        key = (interval, num_layers)
        if interval > 0 and self.is_checkpointable_results_interval != key:
            self.is_checkpointable_results = [self._is_checkpointable(self.forward_funcs[s:s + interval])
                                              for s in range(0, num_layers, interval)]
            self.is_checkpointable_results_interval = key

    def _is_checkpointable(self, funcs: Sequence[Any]) -> bool:
        """Whether a chunk of layers is recomputed: GPT pipe models checkpoint their transformer layers (and any
        ``checkpointable_layers``) unless the checkpoint function is non-reentrant; otherwise the layers named in
        ``checkpointable_layers``, or (``None``) any chunk with parameters."""
        if self.activation_checkpoint_func is not non_reentrant_checkpoint \
                and self.__class__.__name__ in _GPT_PIPE_MODELS:
            return all("ParallelTransformerLayerPipe" in f.__class__.__name__
                       or (self.checkpointable_layers is not None
                           and f.__class__.__name__ in self.checkpointable_layers) for f in funcs)
        if self.checkpointable_layers is not None:
            return all(f.__class__.__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def set_checkpoint_interval(self, interval: int) -> None:
        _check_options(interval, None)
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()  # the cached chunk results must match the new interval now

    # ------------------------------------------------------------ tied weights

    def _index_tied_modules(self) -> dict[str, dict[str, Any]]:
        """One group per tied key and data/model coordinate, holding the ranks of every stage that owns a layer
        with that key; created on every rank in the same (sorted) order."""
        tied_comms: dict[str, dict[str, Any]] = {}
        if self.num_stages == 1 or self._grid is None:
            return tied_comms
        specs = self._layer_specs
        for key in sorted({s.key for s in specs if isinstance(s, TiedLayerSpec)}):
            stages = sorted({self.stage_owner(i) for i, s in enumerate(specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            for coords in self._replica_coords():
                tied_ranks = [self._grid.stage_to_global(s, **coords) for s in stages]
                group = dist.new_group(ranks=tied_ranks)
                if self.global_rank not in tied_ranks:
                    continue
                tied_comms[key] = {"ranks": tied_ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                   "module": self.tied_modules[key]}
                if self.global_rank != tied_ranks[0]:  # counted once by the optimizer (norms, overflow)
                    for p in self.tied_modules[key].parameters():
                        p.ds_pipe_replicated = True
        return tied_comms

    def _replica_coords(self) -> list[dict[str, int]]:
        """Every (data, model) coordinate of the topology, as ``stage_to_global`` overrides."""
        axes = [a for a in ("data", "model") if a in self._topo.get_axis_names()]
        coords: list[dict[str, int]] = [{}]
        for axis in axes:
            coords = [{**c, axis: i} for c in coords for i in range(self._topo.get_dim(axis))]
        return coords

    def _tied_weights(self) -> list[tuple[torch.Tensor, Any, list[int]]]:
        return [(_recursive_getattr(self.tied_modules[key], attr), comm["group"], comm["ranks"])
                for key, comm in self.tied_comms.items() for attr in comm["weight_attr"]]

    def allreduce_tied_weight_gradients(self) -> None:
        """All reduce the gradients of the tied weights between tied stages (a missing gradient counts as 0)."""
        for weight, group, _ in self._tied_weights():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=group)

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        return [(weight, group) for weight, group, _ in self._tied_weights()]

    def _synchronize_tied_weights(self) -> None:
        """Every owner of a tied weight starts from the copy of the lowest rank among them."""
        for weight, group, ranks in self._tied_weights():
            dist.broadcast(weight.data, src=min(ranks), group=group)

    # ------------------------------------------------------------ topology and checkpoint paths

    def topology(self) -> ProcessTopology:
        """ProcessTopology object to query process mappings."""
        return self._topo

    def mpu(self) -> PipelineParallelGrid | None:
        """The PipelineParallelGrid (``None`` in a single process without torch.distributed)."""
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self._topo.get_dim("pipe")

    def ckpt_prefix(self, checkpoints_path: str, tag: Any) -> str:
        """Build a prefix for all checkpoint files written by this module."""
        coord = self._topo.get_coord(rank=self.global_rank)
        rank_name = "module" + "".join(f"-{axis}_{getattr(coord, axis):02d}"
                                       for axis in self._topo.get_axis_names() if axis != "data")
        return os.path.join(checkpoints_path, str(tag), rank_name)

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """Customize a prefix for a specific pipeline module layer."""
        idx = local_layer_idx + self._local_start
        path = os.path.join(ckpt_dir, f"layer_{idx:02d}")
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        if rank_repr != "":
            path += f"-{rank_repr}"
        return path + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        """Get all ckpt file list for a specific pipeline module layer."""
        idx = local_layer_idx + self._local_start
        pattern = os.path.join(glob.escape(ckpt_dir), f"layer_{idx:02d}-") + "*model_states.pt"
        return sorted(glob.glob(pattern))

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """Returns model specific additional losses for reporting: ``{"loss name": loss_value}`` or ``None``."""
        return None

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile every layer with ``torch.compile`` (modules in place, functions replaced)."""
        for idx, layer in enumerate(self.forward_funcs):
            if isinstance(layer, nn.Module):
                layer.compile(*args, **kwargs)
            else:
                self.forward_funcs[idx] = torch.compile(layer, *args, **kwargs)

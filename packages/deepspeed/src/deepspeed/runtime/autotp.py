"""AutoTP training glue: ``tensor_parallel.autotp_size`` shards the model at ``deepspeed.initialize``.

Groups: ``autotp_size`` consecutive ranks form a tensor-parallel group, ranks at the same position in their
groups a data-parallel group (data parallel = world / autotp_size); they are registered as the mpu so
``deepspeed.utils.groups``, ZeRO (reduces over the data-parallel group) and gradient clipping (norm summed over
the tensor group, replicated parameters counted once) all see them. Layer rules, by priority:
``partition_config`` > the model's Hugging Face tp_plan (config, class and instance plans merged) > ``preset_model``
/ AutoTP heuristics.
Checkpoints keep full (gathered) weights in the model states, so they load into a model without TP or at
another TP size (the weights; optimizer states by a plain load only at the saved size). The model states also
record each sharded parameter's layout (``autotp_layouts``), so ``ds_to_universal`` puts values and optimizer
moments back together and a Universal Checkpoint resumes at any TP size (:meth:`AutoTPCheckpointShards.
universal_reader` cuts each rank's shard at load).
ZeRO-3 partitions each rank's tensor shard over its data-parallel group (bf16/fp32, no clipping: ds_config says
why). The first forward checks that every rank of a tensor group got the same inputs (:class:`TPInputCheck`).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.checkpoint.autotp_universal import AUTOTP_LAYOUTS, AUTOTP_PARAM_NAMES, universal_checkpoint_info
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.checkpoint.universal import stage0_optimizer
from deepspeed.module_inject.layers import collect_autotp_universal_checkpoint_info
from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan
from ds_config import ConfigError, ConfigProblem
from ds_inference.autotp import (
    AutoTPPresets,
    TPLayerSpec,
    autotp_shard,
    full_state_dict,
    hf_tp_plan_specs,
    set_autotp_mode,
    tp_layers,
)
from ds_inference.autotp.sharding import ShardLayout

_RECORDED: dict[str, Any] = {}  # tp_model_init's arguments, merged with the config at initialize()


class AutoTPGroups:
    """The mpu of AutoTP training: tensor groups of ``tp_size`` consecutive ranks, data groups across them."""

    def __init__(self, tp_size: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % tp_size:
            raise ConfigError(ConfigProblem("tensor_parallel.autotp_size", f"must divide the world size ({world}); "
                                            f"accepted: a divisor of {world}", tp_size))
        self.tp, self.dp = tp_size, world // tp_size
        tensor = [dist.new_group(list(range(b * tp_size, (b + 1) * tp_size))) for b in range(self.dp)]
        data = [dist.new_group(list(range(i, world, tp_size))) for i in range(tp_size)]  # collective: all ranks
        self._tensor, self._data = tensor[rank // tp_size], data[rank % tp_size]

    def get_tensor_model_parallel_group(self) -> Any:
        return self._tensor

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return dist.get_rank(self._tensor)

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank

    def get_data_parallel_group(self) -> Any:
        return self._data

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._data)


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None,
                  **kwargs: Any) -> torch.nn.Module:
    """Record AutoTP arguments for the next ``deepspeed.initialize`` (which shards; kept for old scripts):
    ``tp_size`` must agree with ``tensor_parallel.autotp_size`` when the config sets it; ``tp_group=`` (keyword)
    gives the tensor-parallel group. Returns ``model`` unchanged."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive int, got {tp_size!r}")
    unknown = set(kwargs) - {"tp_group"}
    if unknown:
        raise TypeError(f"tp_model_init: unexpected keyword arguments {sorted(unknown)}; accepted: tp_group")
    new = {"tp_size": tp_size, "dtype": dtype, "tp_group": kwargs.get("tp_group")}
    if _RECORDED and (_RECORDED["tp_size"], _RECORDED["dtype"]) != (tp_size, dtype):
        raise ValueError(f"tp_model_init: conflicting calls (tp_size={_RECORDED['tp_size']}, "
                         f"dtype={_RECORDED['dtype']} then tp_size={tp_size}, dtype={dtype})")
    _RECORDED.update(new)
    set_autotp_mode(training=True)
    return model


def _tp_size(config: Any, mpu: Any) -> int:
    """The AutoTP degree: the config's, merged with ``tp_model_init``'s record (which is written into the
    config's ``tensor_parallel.autotp_size`` when the config leaves it unset, so the engine reports it)."""
    section = config.tensor_parallel
    size = section.autotp_size if section.autotp_size > 1 else 0
    recorded = _RECORDED.get("tp_size")
    if recorded is None:
        return size
    if size and recorded != size:
        raise ConfigError(ConfigProblem("tensor_parallel.autotp_size", f"tp_model_init was called with tp_size="
                                        f"{recorded}; accepted: {recorded}", size))
    if _RECORDED.get("tp_group") is not None and mpu is not None:
        raise ValueError("deepspeed.initialize: tp_model_init provided tp_group, so mpu must not be passed as well")
    _check_recorded_dtype(config)
    section.autotp_size = recorded
    return recorded


_PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _check_recorded_dtype(config: Any) -> None:
    """``tp_model_init(dtype=...)`` must agree with the config's half precision when it enables one (an fp32
    config takes the recorded dtype as the model's, as DeepSpeed does)."""
    recorded, trains = _RECORDED.get("dtype"), _PRECISIONS.get(config.precision)
    if recorded is not None and trains is not None and recorded != trains:
        raise ConfigError(ConfigProblem("fp16/bf16", f"Conflicting dtype: tp_model_init was called with dtype="
                                        f"{recorded}, the config trains in {config.precision}; make them agree",
                                        config.precision))


def _groups(tp_size: int, mpu: Any) -> Any:
    if mpu is None and _RECORDED.get("tp_group") is None:
        return AutoTPGroups(tp_size)
    group = _RECORDED.get("tp_group") or mpu.get_tensor_model_parallel_group()
    if dist.get_world_size(group) != tp_size:
        raise ConfigError(ConfigProblem("tensor_parallel.autotp_size", f"the given tensor-parallel group has "
                                        f"{dist.get_world_size(group)} ranks", tp_size))
    return mpu if mpu is not None else _GroupMpu(group)


def data_parallel_ranks(tensor_groups: list[list[int]], world: int) -> list[list[int]]:
    """Data-parallel groups that go with the given tensor groups (global ranks in tensor-rank order): the ranks
    at the same tensor-parallel position. The groups must tile the world with one size."""
    flat = sorted(r for g in tensor_groups for r in g)
    if flat != list(range(world)) or len({len(g) for g in tensor_groups}) != 1:
        raise ValueError(f"tp_model_init: the tensor-parallel groups of the ranks {tensor_groups} do not split the "
                         f"{world} ranks into disjoint groups of one size; accepted: every rank in exactly one "
                         "group, all groups of tp_size ranks")
    return [[g[i] for g in tensor_groups] for i in range(len(tensor_groups[0]))]


class _GroupMpu(AutoTPGroups):
    """The mpu of a tensor group passed to ``tp_model_init``: data parallel across the ranks holding the same
    tensor-parallel position, whatever ranks the groups hold (consecutive or strided)."""

    def __init__(self, group: Any) -> None:  # not super().__init__: the tensor group is given
        self._tensor, self.tp = group, dist.get_world_size(group)
        self.dp = dist.get_world_size() // self.tp
        mine = [dist.get_global_rank(group, i) for i in range(self.tp)]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        groups = sorted({tuple(g) for g in everyone}, key=min)
        data = [dist.new_group(ranks) for ranks in data_parallel_ranks([list(g) for g in groups],
                                                                        dist.get_world_size())]
        self._data = data[dist.get_rank(group)]


def layer_specs(model: torch.nn.Module, section: Any) -> list[TPLayerSpec] | None:
    """The rules by the documented priority (None: AutoTP heuristics). ``use_default_specs`` appends the
    ``preset_model`` specs after the custom ones (the spec: "when preset_model is provided"; without it the
    custom specs alone apply, as in DeepSpeed)."""
    preset_name = section.preset_model
    preset = AutoTPPresets.get_preset(preset_name) if preset_name else None
    custom = section.partition_config
    if custom is not None:
        specs = [TPLayerSpec(patterns=list(s.patterns), partition_type=s.partition_type, shape=s.shape,
                             partition_dim=s.partition_dim, model_types=s.model_types,
                             gather_output=s.gather_output, grad_allreduce=s.grad_allreduce)
                 for s in custom.layer_specs]
        if custom.use_default_specs and preset is not None:
            specs += preset.layer_specs
        return specs
    plan = _get_hf_tp_plan(model)  # config's base plan + the class's and instance's entries (lm_head)
    try:
        from_hf = hf_tp_plan_specs(plan)
    except ValueError as exc:
        raise ConfigError(ConfigProblem("tensor_parallel.partition_config", str(exc), None)) from None
    if from_hf is not None:
        return from_hf
    return preset.layer_specs if preset is not None else None


def _remap(params: Any, renamed: Mapping[int, torch.nn.Parameter]) -> Any:
    return [renamed.get(id(p), p) for p in params]


def apply_autotp(model: Any, config: Any, mpu: Any, model_parameters: Any, optimizer: Any,
                 before_shard: Callable[[Any], None] | None = None) -> tuple[Any, Any, Any]:
    """Shard ``model`` when the config (or ``tp_model_init``) asks for AutoTP; returns the mpu to use and the
    parameter list / client optimizer pointed at the sharded tensors. ``tp_model_init``'s record serves this
    one ``initialize`` even when it fails, so a corrected retry does not inherit a stale tp_size."""
    try:
        return _apply_autotp(model, config, mpu, model_parameters, optimizer, before_shard)
    finally:
        _RECORDED.clear()


def _apply_autotp(model: Any, config: Any, mpu: Any, model_parameters: Any, optimizer: Any,
                  before_shard: Callable[[Any], None] | None = None) -> tuple[Any, Any, Any]:
    section = config.tensor_parallel
    tp_size = _tp_size(config, mpu)
    if tp_size <= 1:
        return mpu, model_parameters, optimizer
    if config.checkpoint.use_node_local_storage:
        raise ConfigError(ConfigProblem("checkpoint.use_node_local_storage", "AutoTP checkpoints gather the full "
                                        "weights over each tensor group, which needs every rank of the first group "
                                        "to write; accepted: false", True))
    if section.tp.tp_size > 1 and section.tp.tp_size != tp_size:
        raise ConfigError(ConfigProblem("tensor_parallel.tp.tp_size", f"differs from tensor_parallel.autotp_size "
                                        f"({tp_size}); accepted: {tp_size} (or leave it unset)", section.tp.tp_size))
    if section.replace_with_kernel_inject:
        warnings.warn("tensor_parallel.replace_with_kernel_inject: fused kernels are not available in this "
                      "version; AutoTP trains with plain torch layers", UserWarning, stacklevel=3)
    mpu = _groups(tp_size, mpu)
    if before_shard is not None:  # AutoEP folding: its layers exist before AutoTP, which then leaves them alone
        before_shard(mpu)
    set_autotp_mode(training=True)
    before = dict(model.named_parameters())
    autotp_shard(model, mpu.get_tensor_model_parallel_group(), layer_specs=layer_specs(model, section),
                 tp_grain_size=section.tp.tp_grain_size, keep_module_on_host=True)
    TPInputCheck(model, mpu.get_tensor_model_parallel_group())
    # the conversion rules ds_to_universal follows, on the model as DeepSpeed publishes them
    setattr(model, UNIVERSAL_CHECKPOINT_INFO, collect_autotp_universal_checkpoint_info(model))
    after = dict(model.named_parameters())
    renamed = {id(p): after[n] for n, p in before.items() if n in after and after[n] is not p}
    if isinstance(model_parameters, (list, tuple)):
        model_parameters = _remap(model_parameters, renamed)
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = _remap(group["params"], renamed)
    return mpu, model_parameters, optimizer


TP_INPUT_MISMATCH = ("Data inconsistency within the TP group. Please check the Dataloader implementation to ensure "
                     "consistency.")


def _same(a: Any, b: Any) -> bool:
    """Equal structures: tensors equal in shape and values (compared on the CPU), containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and torch.equal(a.detach().cpu(), b.detach().cpu())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


class TPInputCheck:
    """The first forward's inputs must be the same on every rank of a tensor group (each computes a slice of
    one sample); as DeepSpeed: tensor rank 0 broadcasts its positional and keyword inputs, every rank compares,
    and a mismatch anywhere raises ``AssertionError`` on every rank of the group (after one all-reduce, so none
    goes on to the layers' collectives alone). Passed once, the hook removes itself."""

    def __init__(self, module: torch.nn.Module, group: Any) -> None:
        self.group = group
        self._handle = module.register_forward_pre_hook(self, prepend=True, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        src = dist.get_global_rank(self.group, 0)
        sent: list[Any] = [(args, kwargs) if dist.get_rank() == src else None]
        dist.broadcast_object_list(sent, src=src, group=self.group)
        agree = torch.tensor([int(_same((args, kwargs), sent[0]))])
        dist.all_reduce(agree, group=self.group)
        if int(agree) != dist.get_world_size(self.group):
            raise AssertionError(TP_INPUT_MISMATCH)
        self._handle.remove()


class AutoTPCheckpointShards:
    """Checkpoint extension: the model states hold full weights (gathered over the tensor group at save, each
    rank's shard cut out again at load), so ``mp_rank_00_model_states.pt`` loads into a model without TP, and the
    weights load at another ``autotp_size`` (optimizer states only at the saved one: ``checkpointing._tp_resize``;
    at any size through a Universal Checkpoint). ``engine`` (held weakly) names a ZeRO-0 optimizer's parameters
    (``autotp_param_names``) for ``ds_to_universal``."""

    owns_optimizer_state = False
    owns_module_state = False

    def __init__(self, module: torch.nn.Module, tp_size: int, engine: Any = None) -> None:
        self.module, self.tp_size = module, tp_size
        self.autotp_size = tp_size  # read by the checkpoint loader: loads across TP sizes (see _tp_resize)
        self._engine = weakref.ref(engine) if engine is not None else (lambda: None)  # no engine kept alive

    def _stage0_optimizer(self) -> tuple[Any, list[torch.nn.Parameter], list[str]] | None:
        return stage0_optimizer(getattr(self._engine(), "optimizer", None), self.module)

    def model_state_extras(self) -> dict[str, Any]:
        layouts = autotp_layouts(self.module)
        shapes = {n: tuple(p.shape) for n, p in self.module.named_parameters() if p.requires_grad}
        extras = {"autotp_size": self.tp_size, AUTOTP_LAYOUTS: layouts,  # DeepSpeed's merge rules too:
                  UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(layouts, shapes)}
        stage0 = self._stage0_optimizer()
        if stage0 is not None:  # ds_to_universal finds each parameter's moments by these names
            extras[AUTOTP_PARAM_NAMES] = stage0[2]
        return extras

    def universal_reader(self, load: Callable[[str], Any]) -> Callable[[str], Any]:
        """``load`` for a Universal Checkpoint: ``zero/<name>/<key>.pt`` of a sharded parameter (the full fp32
        value or moment) comes back as this rank's shard, cut with the parameter's own layout (fused QKV and
        gate/up pieces included), so ZeRO's universal load fills the shard's partitions and moments."""
        sharded = {f"{name}.{pname}": (layer._tp_layouts[pname], layer.tp_index, dim)
                   for name, layer in tp_layers(self.module).items()
                   for pname, dim in layer.partition_dims().items() if dim is not None}

        def read(rel: str) -> Any:
            obj = load(rel)
            parts = os.path.normpath(rel).split(os.sep)
            name = os.sep.join(parts[1:-1]) if len(parts) >= 3 and parts[0] == "zero" else None
            if name not in sharded or parts[-1] == "step.pt":
                return obj
            layout, index, dim = sharded[name]
            full = obj.get("param") if isinstance(obj, dict) else obj
            if not isinstance(full, torch.Tensor) or full.dim() <= dim or full.shape[dim] != layout.full:
                return obj  # not a full value (read_universal names the mismatch)
            shard = layout.take(full, index, dim)
            return {**obj, "param": shard} if isinstance(obj, dict) else shard

        return read

    def load_universal(self, ctx: Any, load: Callable[[str], Any]) -> None:
        """Nothing of its own: the weights come from the model states (cut by :meth:`complete_module_state`), the
        fp32 values and moments through ZeRO's universal load (ZeRO 1/2) or the loader's ZeRO-0 one, both reading
        through :meth:`universal_reader`."""
        return None

    def strip_module_state(self, weights: dict[str, Any]) -> dict[str, Any]:
        weights = dict(weights)
        for name, layer in tp_layers(self.module).items():  # collective over the tensor group
            for pname, full in layer.gather_params().items():
                if f"{name}.{pname}" in weights:
                    weights[f"{name}.{pname}"] = full.cpu()
        return weights

    def complete_module_state(self, weights: dict[str, Any], load: Callable[[str], Any]) -> dict[str, Any]:
        for name, layer in tp_layers(self.module).items():
            for pname, dim in layer.partition_dims().items():
                key = f"{name}.{pname}"
                if dim is not None and key in weights:
                    layout: ShardLayout = layer._tp_layouts[pname]
                    weights[key] = layout.take(weights[key], layer.tp_index, dim)
        return weights

    def files_to_save(self, ctx: Any) -> dict[str, Any]:
        return {}

    def load_files(self, ctx: Any, load: Callable[[str], Any]) -> None:
        return None


def autotp_layouts(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """``{parameter name: {"dim", "full", "pieces"}}`` of every sharded parameter: the split dimension, its full
    length and, per tensor-parallel rank, the ``(start, length)`` ranges of the full dimension the rank holds
    (several for fused QKV / gate-up). Plain ints and lists, so a weights-only load reads them."""
    out: dict[str, dict[str, Any]] = {}
    for name, layer in tp_layers(module).items():
        for pname, dim in layer.partition_dims().items():
            if dim is not None:
                layout: ShardLayout = layer._tp_layouts[pname]
                out[f"{name}.{pname}"] = {"dim": int(dim), "full": int(layout.full),
                                          "pieces": [[[int(s), int(n)] for s, n in rank] for rank in layout.pieces]}
    return out


def full_module_state(module: torch.nn.Module) -> dict[str, Any] | None:
    """The module's state dict with full (gathered) weights when it has AutoTP layers, else None (collective)."""
    return full_state_dict(module) if tp_layers(module) else None


def checkpoint_shards(engine: Any) -> tuple[Any, ...]:
    """The engine's checkpoint extensions plus AutoTP's when its model is sharded."""
    shards = tuple(getattr(engine, "checkpoint_shards", ()))
    if not tp_layers(engine.module):
        return shards
    return (*shards, AutoTPCheckpointShards(engine.module, engine.mp_world_size, engine))

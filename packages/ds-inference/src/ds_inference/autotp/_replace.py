"""DeepSpeed's entry points around AutoTP: the ``AutoTP`` class (policy parsing, in-place replacement) and
``replace_transformer_layer``. Kernel injection (fused CUDA inference kernels) is not part of this version:
asking for it warns once and the plain AutoTP path runs instead."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from ds_inference.autotp._layers import (
    Conv_LinearALlreduce,
    HiddenParallelEmbedding,
    LinearAllreduce,
    LinearLayer,
    LmHeadLinearAllreduce,
    conv_LinearLayer,
)
from ds_inference.autotp._policy import (
    REPLICATED_NAMES,
    ROW_SUFFIXES,
    _before_norm,
    _ends_with,
    find_blocks,
    is_conv1d,
    is_linear,
)
from ds_inference.autotp._shard import autotp_shard
from ds_inference.autotp._specs import AutoTPConfig, PartitionType, TPLayerSpec
from ds_inference.autotp._subparam_layers import SubParamLinearAllreduce, SubParamLinearLayer
from ds_inference.autotp.sharding import ShardMeta, make_layout

KERNEL_INJECT_MESSAGE = ("replace_with_kernel_inject: DeepSpeed's fused inference kernels are not available in this "
                         "version; the model is sharded with AutoTP instead (same outputs, plain torch kernels)")


class AutoTP:
    """Automatic tensor parallelism over one model (DeepSpeed's ``AutoTP``): ``tp_parser`` finds the blocks and
    their all-reduce linears, ``_replace_module`` shards in place."""

    def __init__(self, module: nn.Module, all_reduce_linears: Any, prefix: str = "", state_dict: Any = None,
                 linear_layer_setting: Any = None, orig_layer_impl: Any = None, keep_module_on_host: bool = False,
                 partition_config: AutoTPConfig | None = None, vocab_parallel_lm_head: bool = False,
                 model_config: Any = None, tp_grain_size: int = 1, training_mode: bool = False) -> None:
        if vocab_parallel_lm_head:
            raise ValueError("AutoTP: vocab_parallel_lm_head is not supported; the output head is split along the "
                             "hidden dimension")
        self.module = module
        self.all_reduce_linears = tuple(all_reduce_linears or ())
        self.prefix, self.state_dict = prefix, state_dict
        self.orig_layer_impl = orig_layer_impl
        self.keep_module_on_host = keep_module_on_host
        self.partition_config = partition_config
        self.tp_grain_size = tp_grain_size
        self.training_mode = training_mode
        self.linear_layer_setting = linear_layer_setting
        self.mp_group: Any = None
        self.mp_size = 1
        self.conv_linear_layer = False
        self.linear_policies: dict[type, str] = {}
        self._tied_gathered: set[str] | None = None  # partition_config path: modules left replicated (see below)

    def set_tensor_parallel_config(self, mp_size: int, mp_group: Any) -> None:
        self.mp_size, self.mp_group = mp_size, mp_group

    @staticmethod
    def get_module_list(model: nn.Module) -> list[nn.Module]:
        """The transformer blocks AutoTP shards (children of the model's outermost ModuleLists)."""
        return [block for _, block, _ in find_blocks(model, None)]

    @staticmethod
    def supported(model: nn.Module) -> bool:
        return bool(AutoTP.get_module_list(model))

    @staticmethod
    def tp_parser(model: nn.Module) -> list[tuple[type, tuple[str, ...]]]:
        """``[(block class, names of its all-reduce linears)]`` by the heuristics (an injection policy)."""
        policy: dict[type, set[str]] = {}
        for block in AutoTP.get_module_list(model):
            before_norm = _before_norm(block)
            rows = {rel for rel, sub in block.named_modules()
                    if rel and is_linear(sub) and not _ends_with(rel, REPLICATED_NAMES)
                    and (_ends_with(rel, ROW_SUFFIXES) or rel in before_norm)}
            if rows:
                policy.setdefault(type(block), set()).update(rows)
        if not policy:
            raise ValueError(f"AutoTP could not determine a policy for {type(model).__name__}; pass "
                             "injection_policy={block class: (names of the all-reduce linears,)}")
        return [(cls, tuple(sorted(rows))) for cls, rows in policy.items()]

    def update_linear_policies(self) -> None:
        """The module classes replaced, and as what: ``linear_layer_setting`` (linear class[, embedding class]),
        else HF ``Conv1D`` for GPT-2 blocks (``conv_linear_layer``: weights stored ``[in, out]``), else
        ``nn.Linear`` and ``nn.Embedding``."""
        setting = self.linear_layer_setting
        impl = self.orig_layer_impl
        self.conv_linear_layer = setting is None and impl is not None and impl.__name__ == "GPT2Block"
        if setting is not None:
            self.linear_policies = {setting[0]: "linear"}
            if len(setting) == 2:
                self.linear_policies[setting[1]] = "embedding"
        elif self.conv_linear_layer:
            from transformers.pytorch_utils import Conv1D

            self.linear_policies = {Conv1D: "linear"}
        else:
            self.linear_policies = {nn.Linear: "linear", nn.Embedding: "embedding"}

    def _get_model_type(self) -> str | None:
        """The model type layer specs filter on: the model config's ``model_type``, else the class name's stem
        (``LlamaDecoderLayer`` -> ``llama``)."""
        model_type = getattr(getattr(self.module, "config", None), "model_type", None)
        if model_type:
            return str(model_type).lower()
        for pattern in (r"(\w+)DecoderLayer", r"(\w+)Block", r"(\w+)Layer"):
            found = re.search(pattern, type(self.module).__name__)
            if found:
                return found.group(1).lower()
        return None

    def _replace_module(self, r_module: nn.Module, prev_name: str = "", prev_class_name: str = "") -> nn.Module:
        """Shard ``r_module`` in place over ``mp_group``. With ``partition_config``: every module with a 2-D
        weight goes to :meth:`_replace_with_config` under its full path from ``r_module`` (the regex specs see
        ``layers.0.self_attn.q_proj``); without: the policy (``orig_layer_impl`` and ``all_reduce_linears`` when
        given, else the heuristics) over the whole model. AutoEP layers (``_is_autoep_layer``) keep their router
        and experts (expert parallelism owns them); only their shared experts are sharded
        (:meth:`_replace_autoep_shared_experts`)."""
        base = ".".join(n for n in (prev_class_name, prev_name) if n)
        autoep = [(name, module) for name, module in r_module.named_modules()
                  if name and getattr(module, "_is_autoep_layer", False)]
        autoep = [(name, module) for name, module in autoep  # outermost ones only
                  if not any(name.startswith(other + ".") for other, _ in autoep)]
        placeholders = []
        for name, module in autoep:
            parent_name, _, attr = name.rpartition(".")
            parent = r_module.get_submodule(parent_name) if parent_name else r_module
            setattr(parent, attr, nn.Identity())
            placeholders.append((parent, attr, module))
        try:
            if any(True for _ in r_module.parameters()):
                r_module = self._replace_plain(r_module, prev_name, prev_class_name)
        finally:
            for parent, attr, module in placeholders:
                setattr(parent, attr, module)
        for name, module in autoep:
            self._replace_autoep_shared_experts(module, f"{base}.{name}" if base else name)
        return r_module

    def _replace_autoep_shared_experts(self, autoep_layer: nn.Module, autoep_name: str) -> None:
        """Shard an AutoEP layer's ``shared_experts`` (and its gate, with a ``partition_config``) like any dense
        MLP: by the layer specs under ``<autoep_name>.shared_experts...``, else by the heuristics."""
        for child_name in ("shared_experts", "shared_experts_gate"):
            child = getattr(autoep_layer, child_name, None)
            if child is None:
                continue
            full_name = f"{autoep_name}.{child_name}"
            if self.partition_config is not None:
                if self._tied_gathered is None:
                    self._tied_gathered = self._tied_gathered_columns()
                weight = getattr(child, "weight", None)
                if isinstance(weight, nn.Parameter) and weight.dim() == 2:
                    setattr(autoep_layer, child_name, self._replace_with_config(child, full_name))
                else:
                    self._walk(child, full_name)
            elif child_name == "shared_experts" and not isinstance(child, nn.Linear):
                # a gated MLP: the heuristics split its projections (the 1-output gate stays replicated)
                autotp_shard(child, self.mp_group, tp_grain_size=self.tp_grain_size,
                             keep_module_on_host=self.keep_module_on_host)

    def _replace_plain(self, r_module: nn.Module, prev_name: str, prev_class_name: str) -> nn.Module:
        if self.partition_config is None:
            policy = {self.orig_layer_impl: self.all_reduce_linears} if self.orig_layer_impl is not None else None
            return autotp_shard(r_module, self.mp_group, injection_policy=policy, tp_grain_size=self.tp_grain_size,
                                keep_module_on_host=self.keep_module_on_host)
        if self._tied_gathered is None:
            self._tied_gathered = self._tied_gathered_columns()
        self._walk(r_module, ".".join(n for n in (prev_class_name, prev_name) if n))
        return r_module

    def _walk(self, parent: nn.Module, path: str) -> None:
        for name, child in list(parent.named_children()):
            full_name = f"{path}.{name}" if path else name
            weight = getattr(child, "weight", None)
            if full_name in self._tied_gathered:
                continue
            if isinstance(child, nn.Embedding):
                new = self._slice_embedding(child, full_name)
            elif isinstance(weight, nn.Parameter) and weight.dim() == 2:
                new = self._replace_with_config(child, full_name)
            else:
                self._walk(child, full_name)
                continue
            if new is not None and new is not child:
                setattr(parent, name, new)

    def _spec(self, full_name: str) -> TPLayerSpec | None:
        param_name = full_name if full_name.endswith(".weight") else full_name + ".weight"
        spec = self.partition_config.find_matching_spec(param_name, self._get_model_type())
        if spec is None and getattr(self.partition_config, "strict_mode", False):
            raise ValueError(f"AutoTP partition_config (strict_mode): no layer spec matches '{param_name}'")
        return spec

    def _replace_with_config(self, child: nn.Module, name: str) -> nn.Module:
        """``child`` replaced as the first layer spec matching ``<name>.weight`` says (unchanged: no match, a
        ``skip`` spec, or already replaced)."""
        if getattr(child, "replaced", False):
            return child
        spec = self._spec(name)
        if spec is None:
            return child
        child.replaced = True
        if spec.partition_type == PartitionType.SKIP:
            return child
        if spec.partition_type == PartitionType.ROW:
            return self._row_layer(child, spec, name)
        return self._column_layer(child, spec, name)

    def _row_layer(self, module: nn.Module, spec: TPLayerSpec, name: str) -> nn.Module:
        if self.conv_linear_layer or is_conv1d(module):
            return Conv_LinearALlreduce(module, self.mp_group, name=name)
        if name in ("lm_head", "embed_out"):
            return LmHeadLinearAllreduce(module, self.mp_group, name=name)
        if spec.shape is not None:
            dim = 1 if spec.partition_dim is None else spec.partition_dim
            return SubParamLinearAllreduce(module, self.mp_group, shape=spec.shape, partition_dim=dim, name=name)
        return LinearAllreduce(module, self.mp_group, name=name)

    def _column_layer(self, module: nn.Module, spec: TPLayerSpec, name: str) -> nn.Module:
        if self.conv_linear_layer or is_conv1d(module):
            return conv_LinearLayer(module, self.mp_group, name=name, gather_output=spec.gather_output)
        if spec.shape is not None:
            if spec.gather_output:
                raise ValueError(f"AutoTP layer spec {spec.patterns} for '{name}': gather_output needs an unpacked "
                                 "output dimension; accepted: shape unset, or gather_output false")
            dim = 0 if spec.partition_dim is None else spec.partition_dim
            return SubParamLinearLayer(module, self.mp_group, shape=spec.shape, partition_dim=dim, name=name)
        return LinearLayer(module, self.mp_group, name=name, gather_output=spec.gather_output)

    def _slice_embedding(self, child: nn.Embedding, name: str) -> nn.Module:
        """An embedding a (non-skip) spec matches is split along its hidden dimension; others stay whole."""
        spec = self._spec(name)
        if spec is None or spec.partition_type == PartitionType.SKIP or getattr(child, "replaced", False):
            return child
        size = dist.get_world_size(self.mp_group) if dist.is_initialized() else 1
        meta = ShardMeta(tp_size=size, tp_grain_size=self.tp_grain_size)
        return HiddenParallelEmbedding(child, self.mp_group, make_layout([child.embedding_dim], meta, by_heads=False),
                                       name=name)

    def _tied_gathered_columns(self) -> set[str]:
        """Modules left replicated: an output layer whose weight is an embedding's (tied at run time, whatever
        the config says) and a column spec with ``gather_output`` matches it, with that embedding; a
        vocabulary-split pair sharing one gathered shard is not built."""
        named = list(self.module.named_modules())
        embeddings = [(n, m) for n, m in named if isinstance(m, nn.Embedding)]
        get_input = getattr(self.module, "get_input_embeddings", None)
        extra = get_input() if callable(get_input) else None
        if extra is not None and all(m is not extra for _, m in embeddings):
            embeddings += [(n, m) for n, m in named if m is extra]
        left: set[str] = set()
        for name, module in named:
            weight = getattr(module, "weight", None)
            if not name or isinstance(module, nn.Embedding) or weight is None:
                continue
            tied = next((n for n, emb in embeddings if emb.weight is weight), None)
            spec = self.partition_config.find_matching_spec(name + ".weight", self._get_model_type())
            if tied is not None and spec is not None and spec.partition_type == PartitionType.COLUMN \
                    and spec.gather_output:
                warnings.warn(f"AutoTP: '{name}.weight' is tied to '{tied}.weight'; both stay replicated (a "
                              "gathered column split of a tied output layer is not built)", UserWarning, stacklevel=3)
                left.update((name, tied))
        return left


def _field(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if value is not None:
            return value
    return default


def replace_transformer_layer(orig_layer_impl: Any, model: nn.Module, checkpoint_dict: Any, config: Any,
                              model_config: Any, training_mode: bool = False,
                              replacement_sources: Any = None) -> nn.Module:
    """Shard ``model`` for tensor-parallel inference as ``config`` (a ``DeepSpeedInferenceConfig`` or dict) says:
    ``tensor_parallel.tp_size``/``tp_group``/``tp_grain_size``, ``injection_policy``, ``keep_module_on_host``.
    ``replace_with_kernel_inject`` warns and takes this AutoTP path (no fused kernels in this version)."""
    config = config if config is not None else {}
    if checkpoint_dict is not None:
        raise ValueError("replace_transformer_layer: checkpoint_dict loading belongs to init_inference; load the "
                         "weights into the model first")
    if _field(config, "replace_with_kernel_inject", "kernel_inject", default=False):
        warnings.warn(KERNEL_INJECT_MESSAGE, UserWarning, stacklevel=2)
    tp = _field(config, "tensor_parallel", "tp", default={})
    group = _field(tp, "tp_group")
    tp_size = int(_field(tp, "tp_size", default=dist.get_world_size(group) if dist.is_initialized() else 1))
    if tp_size <= 1:
        return model
    if dist.get_world_size(group) != tp_size:
        raise ValueError(f"replace_transformer_layer: tensor_parallel.tp_size={tp_size} but the tensor-parallel "
                         f"group has {dist.get_world_size(group)} ranks")
    policy = _field(config, "injection_policy")
    if policy is None and orig_layer_impl is not None and _field(config, "injection_policy_tuple") is not None:
        policy = {orig_layer_impl: _field(config, "injection_policy_tuple")}
    return autotp_shard(model, group, injection_policy=policy,
                        tp_grain_size=int(_field(tp, "tp_grain_size", default=64)),
                        keep_module_on_host=bool(_field(config, "keep_module_on_host", default=False)))


def revert_transformer_layer(orig_layer_impl: Any, model: nn.Module, config: Any, preln: bool = False) -> nn.Module:
    """Kernel-injected layers do not exist in this version, so there is nothing to revert: ``model`` as is."""
    return model

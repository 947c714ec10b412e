"""DeepSpeed's entry points around AutoTP: the ``AutoTP`` class (policy parsing, in-place replacement) and
``replace_transformer_layer``. Kernel injection (fused CUDA inference kernels) is not part of this version:
asking for it warns once and the plain AutoTP path runs instead."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from ds_inference.autotp._policy import REPLICATED_NAMES, ROW_SUFFIXES, _before_norm, _ends_with, find_blocks, is_linear
from ds_inference.autotp._shard import autotp_shard
from ds_inference.autotp._specs import AutoTPConfig

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
        self.mp_group: Any = None
        self.mp_size = 1

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

    def _replace_module(self, r_module: nn.Module, prev_name: str = "", prev_class_name: str = "") -> nn.Module:
        """Shard ``r_module`` in place over ``mp_group`` (policy: ``orig_layer_impl`` and ``all_reduce_linears``
        when given, else the heuristics; ``partition_config``: regex specs)."""
        policy = {self.orig_layer_impl: self.all_reduce_linears} if self.orig_layer_impl is not None else None
        specs = self.partition_config.layer_specs if self.partition_config is not None else None
        return autotp_shard(r_module, self.mp_group, injection_policy=policy, tp_grain_size=self.tp_grain_size,
                            keep_module_on_host=self.keep_module_on_host, layer_specs=specs)


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

"""``autotp_shard``: replace a model's layers in place by their tensor-parallel versions; ``tp_plan`` and the
full-weight gather/load that checkpoints need."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_inference.autotp import _layers as L
from ds_inference.autotp._policy import (
    Placement,
    block_placements,
    find_blocks,
    head_counts,
    is_conv1d,
    spec_placements,
    tied_vocab_pair,
)
from ds_inference.autotp._specs import TPLayerSpec
from ds_inference.autotp.sharding import ShardMeta, make_layout, shard_sizes

# Attention attributes that count heads or head-widths; scaled to this rank's share (DeepSpeed's list, plus
# GPT-2's ``split_size``). ``head_dim`` stays whole.
HEAD_ATTRIBUTES = ("n_heads", "inner_dim", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads",
                   "all_head_size", "embed_dim", "hidden_size", "num_key_value_heads", "num_kv_heads",
                   "kv_n_heads", "d_model", "split_size")


def _owned_by_expert_parallelism(name: str, modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``name`` lies inside an AutoEP layer (``_is_autoep_layer``) outside its shared experts: its router
    stays replicated and its experts are sharded over the expert-parallel group, not the tensor group."""
    parts = name.split(".")
    for i in range(len(parts)):
        if getattr(modules.get(".".join(parts[:i])), "_is_autoep_layer", False):
            return i >= len(parts) or not parts[i].startswith("shared_experts")
    return False


def autotp_shard(model: nn.Module, tp_group: dist.ProcessGroup | None, *,
                 injection_policy: Mapping[Any, Any] | None = None, tp_grain_size: int = 64,
                 keep_module_on_host: bool = False, layer_specs: Sequence[TPLayerSpec] | None = None,
                 shard_embeddings: bool | None = None) -> nn.Module:
    """Shard ``model`` in place over ``tp_group`` and return it.

    Without ``layer_specs`` the layers are chosen by AutoTP's heuristics (or ``injection_policy``: ``{block
    class or class name: (names of the row-parallel linears,)}``) and the input embedding / output head are
    split along the hidden dimension (``shard_embeddings``, default on). With ``layer_specs`` (regex rules,
    first match wins) only matching linears are sharded. Attention modules get their head counts scaled to
    the local heads. ``keep_module_on_host`` keeps shards on the CPU; otherwise they move to the current CUDA
    device when there is one. Outputs equal the unsharded model's.
    """
    if not isinstance(tp_grain_size, int) or tp_grain_size < 1:
        raise ValueError(f"tp_grain_size must be a positive int, got {tp_grain_size!r}")
    tp_size = dist.get_world_size(group=tp_group)
    config = getattr(model, "config", None)
    _, kv_heads, _ = head_counts(config)
    meta = ShardMeta(tp_size=tp_size, num_kv_heads=kv_heads, tp_grain_size=tp_grain_size)
    if kv_heads is not None and kv_heads < tp_size:
        warnings.warn(f"AutoTP: tp_size={tp_size} exceeds the model's {kv_heads} key/value heads; the ranks beyond "
                      "them hold no attention shard (outputs stay exact, attention does not scale past the head "
                      "count)", UserWarning, stacklevel=2)
    device = None if keep_module_on_host or not torch.cuda.is_available() else torch.device(
        "cuda", torch.cuda.current_device())
    output_head = _output_head(model)
    vocab_pair = None
    if layer_specs is not None:
        model_type = getattr(config, "model_type", None)
        vocab_pair = tied_vocab_pair(model, list(layer_specs), model_type, output_head, tp_size)
        placements = spec_placements(model, list(layer_specs), model_type, output_head, vocab_pair)
    else:
        placements = {}
        for block_name, block, rows in list(find_blocks(model, injection_policy)):
            placements.update(block_placements(block_name, block, rows, config))
        if not placements:
            raise ValueError(f"AutoTP found no linear layers to shard in {type(model).__name__}; pass "
                             "injection_policy={block class: (names of the all-reduce linears,)}")
    modules = dict(model.named_modules())
    placements = {name: p for name, p in placements.items() if not _owned_by_expert_parallelism(name, modules)}
    if tp_size == 1:
        return model
    attention_parents = set()
    for name, placement in placements.items():
        _replace(model, name, _tp_layer(modules[name], name, placement, meta, tp_group, device))
        parent = name.rpartition(".")[0]
        if placement.kind == "column" and placement.by_heads and _is_attention(parent):
            attention_parents.add(parent)
    for parent in sorted(attention_parents):
        _scale_head_attributes(modules[parent], meta, dist.get_rank(group=tp_group))
    if vocab_pair is not None:
        head_name, embedding_name = vocab_pair
        _replace(model, embedding_name, L.VocabParallelEmbedding(modules[embedding_name],
                                                                 model.get_submodule(head_name), name=embedding_name))
    if shard_embeddings if shard_embeddings is not None else layer_specs is None:
        _shard_embeddings(model, meta, tp_group, device, skip=set(placements) | set(vocab_pair or ()))
    if layer_specs is not None:
        _sum_replicated_grads(model, list(layer_specs), getattr(config, "model_type", None), tp_group)
    return model


def _sum_replicated_grads(model: nn.Module, specs: list[TPLayerSpec], model_type: str | None,
                          group: dist.ProcessGroup | None) -> None:
    """Parameters of ``grad_allreduce`` specs stay whole but act on this rank's share of the activations (Qwen3's
    q_norm/k_norm over the local heads), so each rank computes a partial gradient: a hook sums it over the group
    as soon as autograd produces it (before accumulation), or the replicas drift apart after the first step."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad

    for name, param in model.named_parameters():
        spec = next((s for s in specs if s.matches(name, model_type)), None)
        if spec is None or not spec.grad_allreduce or getattr(param, "_ds_grad_allreduce_registered", False):
            continue
        param.register_hook(hook)
        param._ds_grad_allreduce_registered = True


def _tp_layer(module: nn.Module, name: str, placement: Placement, meta: ShardMeta,
              group: dist.ProcessGroup | None, device: torch.device | None) -> nn.Module:
    layout = make_layout(placement.sub_sizes, meta, by_heads=placement.by_heads)
    if placement.kind == "row":
        if placement.replicated_input:
            return L.LmHeadLinearAllreduce(module, group, layout, name=name, device=device)
        cls = L.Conv_LinearALlreduce if is_conv1d(module) else L.LinearAllreduce
        return cls(module, group, layout, name=name, device=device)
    cls = L.conv_LinearLayer if is_conv1d(module) else L.LinearLayer
    return cls(module, group, layout, name=name, gather_output=placement.gather_output, device=device)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


def _is_attention(name: str) -> bool:
    """Attention modules by name (``attn``, ``self_attn``, ``attention``, BERT's ``attention.self``): only they get
    their head counts scaled, so an MLP's ``hidden_size`` is never touched."""
    leaf = name.rpartition(".")[2]
    return "att" in leaf.lower() or leaf == "self"


def _scale_head_attributes(module: nn.Module, meta: ShardMeta, rank: int) -> None:
    for attr in HEAD_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            setattr(module, attr, shard_sizes(value, meta, by_heads=True)[rank])


def _output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, nn.Linear) else None


def _shard_embeddings(model: nn.Module, meta: ShardMeta, group: dist.ProcessGroup | None,
                      device: torch.device | None, skip: set[str]) -> None:
    """Split the input embedding and the output head along the hidden dimension; a tied pair shares one shard."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    head = _output_head(model)
    names = {id(m): n for n, m in model.named_modules()}
    new_embedding = None
    if isinstance(embedding, nn.Embedding) and names.get(id(embedding)) not in skip:
        layout = make_layout([embedding.embedding_dim], meta, by_heads=False)
        new_embedding = L.HiddenParallelEmbedding(embedding, group, layout, name=names[id(embedding)],
                                                  device=device)
        _replace(model, names[id(embedding)], new_embedding)
    if head is not None and names.get(id(head)) not in skip:
        layout = make_layout([head.in_features], meta, by_heads=False)
        new_head = L.LmHeadLinearAllreduce(head, group, layout, name=names[id(head)], device=device)
        if new_embedding is not None and head.weight is embedding.weight:
            new_head.weight = new_embedding.weight
        _replace(model, names[id(head)], new_head)


def tp_plan(model: nn.Module) -> dict[str, int | None]:
    """For every parameter name of the (sharded) model, tied aliases included: the dimension it is split
    along, or None when every rank holds the whole tensor. Packed (fused) weights report their split
    dimension; their shards are sub-parameter slices (use :func:`full_state_dict` / :func:`load_full_state_dict`
    to move between full and sharded tensors)."""
    plan = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        plan[name] = owner.partition_dims().get(leaf) if isinstance(owner, L.TensorParallel_Layer) else None
    return plan


def tp_layers(model: nn.Module) -> dict[str, L.TensorParallel_Layer]:
    """The sharded layers of ``model`` by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, L.TensorParallel_Layer)}


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every shard replaced by the full tensor (a collective: call on all TP
    ranks). The result loads into the unsharded model."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for name, layer in tp_layers(model).items():
        for pname, full in layer.gather_params().items():
            state[f"{name}.{pname}"] = full
    return state


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load full (unsharded) tensors into a sharded model: each TP layer keeps its own shard."""
    layers = tp_layers(model)
    own = model.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
    for key, value in state_dict.items():
        if key not in own:
            continue
        owner_name, _, leaf = key.rpartition(".")
        if owner_name in layers:
            layers[owner_name].load_full_param(leaf, value)
        else:
            own[key].copy_(value)

"""Which layers AutoTP shards and how: DeepSpeed's documented heuristics, a user ``injection_policy``, or
regex layer specs.

Heuristics (inference and training without specs): transformer blocks are the children of the model's
outermost ``nn.ModuleList``s; inside a block a linear is row-parallel (followed by an all-reduce) when its name
is one of the known output projections (``o_proj``, ``down_proj``, ``out_proj``, ``c_proj``, ``dense_4h_to_h``,
``fc_out``, ``fc2``, ``w2``, ``*.output.dense``, ``attention.dense`` ...) or when it comes right before a
LayerNorm, column-parallel otherwise; MoE routers and low-rank projections stay replicated.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ds_inference.autotp._specs import PartitionType, TPLayerSpec

ROW_SUFFIXES = ("o_proj", "out_proj", "down_proj", "c_proj", "dense_4h_to_h", "fc_out", "fc2", "w2", "wo",
                "output.dense", "attention.dense", "self_attention.dense", "self_attn.dense")
REPLICATED_NAMES = ("mlp.gate", "block_sparse_moe.gate", "shared_expert_gate", "q_a_proj", "kv_a_proj_with_mqa",
                    "router")
FUSED_QKV = ("c_attn", "qkv_proj", "Wqkv", "qkv")
FUSED_GATE_UP = ("gate_up_proj",)
_NORM_NAMES = ("LayerNorm", "layer_norm", "ln_1", "ln_2")
_NOT_BY_HEADS = ("mlp", "lm_head", "embed_out", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


@dataclass(frozen=True)
class Placement:
    """How one linear is sharded: ``column``/``row``, its packed sub-parameter sizes along the split
    dimension, whether the split keeps whole attention heads, and (column only) an all-gathered output."""

    kind: str
    sub_sizes: tuple[int, ...]
    by_heads: bool
    gather_output: bool = False
    replicated_input: bool = False


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear with its weight stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear or Conv1D."""
    out_f, in_f = module.weight.shape
    return (out_f, in_f) if is_conv1d(module) else (in_f, out_f)


def by_heads(name: str) -> bool:
    """Attention widths are split by whole kv heads; MLP and output-head widths by ``tp_grain_size``."""
    return not any(key in name for key in _NOT_BY_HEADS)


def head_counts(config: Any) -> tuple[int | None, int | None, int | None]:
    """``(num_attention_heads, num_key_value_heads, head_dim)`` from a HF config (None where unknown)."""
    if config is None:
        return None, None, None
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)
    return heads, kv, head_dim


def _fused_sizes(leaf: str, out_features: int, config: Any) -> tuple[int, ...]:
    if leaf in FUSED_GATE_UP and out_features % 2 == 0:
        return (out_features // 2,) * 2
    if leaf in FUSED_QKV:
        heads, kv, head_dim = head_counts(config)
        if heads and kv and head_dim and out_features == (heads + 2 * kv) * head_dim:
            return (heads * head_dim, kv * head_dim, kv * head_dim)
        if out_features % 3 == 0:
            return (out_features // 3,) * 3
    return (out_features,)


def find_blocks(model: nn.Module,
                injection_policy: Mapping[Any, Any] | None) -> Iterator[tuple[str, nn.Module, tuple[str, ...] | None]]:
    """``(name, block, row names or None)``: modules of the policy's classes, else the children of the model's
    outermost ModuleLists that hold linears."""
    if injection_policy:
        rows = {_class_key(k): _names(v) for k, v in injection_policy.items()}
        for name, module in model.named_modules():
            for key in (type(module), type(module).__name__):
                if key in rows:
                    yield name, module, rows[key]
                    break
        return
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        children = [(f"{name}.{i}", c) for i, c in module.named_children()
                    if any(is_linear(m) for m in c.modules())]
        if children:
            taken.append(name)
            yield from ((n, c, None) for n, c in children)


def _class_key(key: Any) -> Any:
    if isinstance(key, (type, str)):
        return key
    raise TypeError(f"injection_policy keys must be module classes or class names, got {key!r}")


def _names(value: Any) -> tuple[str, ...] | None:
    """The all-reduce linears' names; None for a kernel-injection policy class (``HFBertLayerPolicy``), whose
    block is then sharded by the heuristics."""
    if isinstance(value, type):
        return None
    names = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"injection_policy values must be names of linears (strings), got {value!r}")
    return names


def _ends_with(rel: str, names: Sequence[str]) -> bool:
    return any(rel == n or rel.endswith("." + n) for n in names)


def _before_norm(block: nn.Module) -> set[str]:
    """Linears placed right before a LayerNorm in their parent's child order (DeepSpeed's structural rule)."""
    found = set()
    for parent_name, parent in block.named_modules():
        previous = None
        for key, child in parent.named_children():
            if isinstance(child, nn.LayerNorm) or key in _NORM_NAMES:
                if previous is not None:
                    found.add(f"{parent_name}.{previous}" if parent_name else previous)
                previous = None
            else:
                previous = key if is_linear(child) else None
    return found


def block_placements(block_name: str, block: nn.Module, row_names: tuple[str, ...] | None,
                     config: Any) -> dict[str, Placement]:
    """Placement of every linear of one block, keyed by full name (``<block_name>.<relative name>``)."""
    before_norm = _before_norm(block) if row_names is None else set()
    placements = {}
    for rel, module in block.named_modules():
        if not rel or not is_linear(module) or _ends_with(rel, REPLICATED_NAMES):
            continue
        full = f"{block_name}.{rel}" if block_name else rel
        in_f, out_f = features(module)
        row = _ends_with(rel, row_names) if row_names is not None else (
            _ends_with(rel, ROW_SUFFIXES) or rel in before_norm)
        if row:
            placements[full] = Placement("row", (in_f,), by_heads(full))
        else:
            placements[full] = Placement("column", _fused_sizes(rel.rsplit(".", 1)[-1], out_f, config),
                                         by_heads(full))
    return placements


def tied_vocab_pair(model: nn.Module, specs: Sequence[TPLayerSpec], model_type: str | None,
                    output_head: nn.Module | None, tp_size: int) -> tuple[str, str] | None:
    """``(head name, embedding name)`` when the output head shares its weight with an embedding that a
    ``vocab_parallel`` spec (Hugging Face's ``embedding_rowwise``) names: both are then split along the vocabulary.

    An embedding the vocabulary split cannot reproduce exactly (``max_norm``, ``scale_grad_by_freq``, ``sparse``, a
    subclass with its own forward) or a vocabulary smaller than the group keeps the pair whole, with a warning, as
    DeepSpeed does when it enables the split on its own."""
    if output_head is None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    embedding = next((m for m in model.modules()
                      if isinstance(m, nn.Embedding) and m.weight is output_head.weight), None)
    if embedding is None:
        return None
    spec = next((s for s in specs if s.matches(f"{names[id(embedding)]}.weight", model_type)), None)
    if spec is None or not spec.vocab_parallel:
        return None
    problem = None
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        problem = "max_norm, scale_grad_by_freq and sparse are not supported by a vocabulary split"
    elif type(embedding).forward is not nn.Embedding.forward:
        problem = f"{type(embedding).__name__} has its own forward"
    elif embedding.num_embeddings < tp_size:
        problem = f"a vocabulary of {embedding.num_embeddings} leaves ranks of the {tp_size} without rows"
    if problem is not None:
        warnings.warn(f"AutoTP: the tied embedding '{names[id(embedding)]}' and output head stay replicated despite "
                      f"the 'embedding_rowwise' plan: {problem}", UserWarning, stacklevel=3)
        return None
    return names[id(output_head)], names[id(embedding)]


def spec_placements(model: nn.Module, specs: Sequence[TPLayerSpec], model_type: str | None,
                    output_head: nn.Module | None, vocab_pair: tuple[str, str] | None = None) -> dict[str, Placement]:
    """Placement of every linear whose ``<name>.weight`` matches a spec (first match wins); the head of a
    ``vocab_pair`` (:func:`tied_vocab_pair`) is split along the vocabulary with its output gathered, whatever its
    own spec says."""
    placements = {}
    embedding_weights = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        if not is_linear(module):
            continue
        if vocab_pair is not None and name == vocab_pair[0]:
            placements[name] = Placement("column", (features(module)[1],), False, gather_output=True)
            continue
        spec = next((s for s in specs if s.matches(f"{name}.weight", model_type)), None)
        if spec is None or spec.partition_type is PartitionType.SKIP:
            continue
        tied_to = embedding_weights.get(id(module.weight))
        if spec.gather_output and tied_to is not None:
            # a vocabulary-parallel embedding coupled to the sharded head is not built: sharding the head alone
            # would untie it from the embedding, so both stay whole (as DeepSpeed does)
            warnings.warn(f"AutoTP: '{name}.weight' is tied to '{tied_to}.weight'; both stay replicated (a "
                          "gathered column split of a tied output head is not supported)", UserWarning, stacklevel=2)
            continue
        in_f, out_f = features(module)
        is_head = module is output_head
        if spec.partition_type is PartitionType.ROW:
            _check_spec_dim(spec, 1)
            placements[name] = Placement("row", tuple(spec.sub_sizes(in_f)), by_heads(name),
                                         replicated_input=is_head)
        else:
            _check_spec_dim(spec, 0)
            placements[name] = Placement("column", tuple(spec.sub_sizes(out_f)), by_heads(name),
                                         gather_output=is_head or spec.gather_output)
    return placements


def _check_spec_dim(spec: TPLayerSpec, split_dim: int) -> None:
    if spec.shape is not None and spec.partition_dim is not None and spec.partition_dim != split_dim:
        raise ValueError(f"layer spec {spec.patterns}: partition_dim {spec.partition_dim} does not match a "
                         f"{spec.partition_type.value} split (dimension {split_dim} of the [out, in] weight)")

"""Regex layer specs for AutoTP (``partition_config``), the built-in model presets and Hugging Face tp_plans.

Names follow DeepSpeed (``TPLayerSpec``, ``PartitionType``, ``AutoTPConfig``, ``AutoTPPresets``,
``merge_autotp_configs``). Patterns match parameter names (``model.layers.0.self_attn.q_proj.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class PartitionType(str, Enum):
    """How a matched weight is sharded: by output features, by input features, or not at all."""

    COLUMN = "column"
    ROW = "row"
    SKIP = "skip"


@dataclass
class TPLayerSpec:
    """One rule: weights whose name matches one of ``patterns`` are sharded as ``partition_type``.

    ``shape``/``partition_dim`` describe packed sub-parameters along the split dimension: ``shape[partition_dim]``
    is a count of equal chunks (``[2, -1]``: gate/up) or a list of chunk sizes (``[[q, kv, kv], -1]``);
    ``partition_dim`` defaults to the split dimension (0 column, 1 row). ``partition_type`` is case-insensitive.
    ``gather_output`` (column): the output shards are all-gathered so every rank sees the whole output (Hugging
    Face's ``colwise_gather_output``). ``grad_allreduce`` (skip): the weight stays whole but is applied to sharded
    activations, so its gradient is summed over the tensor-parallel group (``replicated_with_grad_allreduce``).
    ``vocab_parallel`` (skip, an embedding; Hugging Face's ``embedding_rowwise``): the embedding stays whole, unless
    the output head shares its weight, in which case both are split along the vocabulary and share one shard.
    """

    patterns: list[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: Sequence[Any] | None = None
    partition_dim: int | None = None
    model_types: list[str] | None = None
    gather_output: bool = False
    grad_allreduce: bool = False
    vocab_parallel: bool = False
    _compiled: list[re.Pattern] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        kind = getattr(self.partition_type, "value", self.partition_type)
        try:
            self.partition_type = PartitionType(str(kind).lower())
        except ValueError:
            raise ValueError(f"AutoTP layer spec {self.patterns}: partition_type {kind!r} is not supported; "
                             f"accepted: {[t.value for t in PartitionType]}") from None
        try:
            self._compiled = [re.compile(p) for p in self.patterns]
        except re.error as exc:
            raise ValueError(f"invalid AutoTP layer spec pattern in {self.patterns}: {exc}") from None
        if self.shape is not None:
            self._check_shape()

    def get_partition_dim(self) -> int:
        """The ``shape`` dimension holding the packed sub-parameters: ``partition_dim`` when given, else the
        split dimension of the ``[out, in]`` weight (0 for a column split, 1 for a row split), as DeepSpeed."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 1 if self.partition_type is PartitionType.ROW else 0

    def _check_shape(self) -> None:
        where = f"AutoTP layer spec {self.patterns}: shape {list(self.shape)}"
        dim = self.get_partition_dim()
        if not 0 <= dim < len(self.shape):
            raise ValueError(f"{where}: partition_dim {dim} is out of range; accepted: 0..{len(self.shape) - 1}")
        for i, entry in enumerate(self.shape):
            if isinstance(entry, (list, tuple)):
                if i != dim or not entry or not all(isinstance(e, int) and e > 0 for e in entry):
                    raise ValueError(f"{where}: a list of sub-parameter sizes is accepted only at partition_dim "
                                     f"({dim}) and must hold positive ints, got {entry!r} at {i}")
            elif not isinstance(entry, int) or isinstance(entry, bool) or not (entry > 0 or entry == -1):
                raise ValueError(f"{where}: entry {entry!r} at {i} is invalid; accepted: a positive int, -1 "
                                 "(inferred) or a list of sizes at partition_dim")

    def matches(self, param_name: str, model_type: str | None = None) -> bool:
        """Whether this rule applies to ``param_name`` (and to the model type, when restricted)."""
        if self.model_types and (model_type or "").lower() not in {t.lower() for t in self.model_types}:
            return False
        return any(p.match(param_name) for p in self._compiled)

    def sub_sizes(self, total: int) -> list[int]:
        """Sizes of the packed sub-parameters along the split dimension (one entry when unpacked)."""
        if self.shape is None:
            return [total]
        entry = self.shape[self.get_partition_dim()]
        if isinstance(entry, (list, tuple)):
            if sum(entry) != total:
                raise ValueError(f"layer spec {self.patterns}: sub-parameter sizes {list(entry)} do not add up "
                                 f"to the weight's {total} features")
            return [int(e) for e in entry]
        if entry == -1:
            return [total]
        if total % entry:
            raise ValueError(f"layer spec {self.patterns}: {total} features do not split into {entry} chunks")
        return [total // entry] * entry


@dataclass
class AutoTPConfig:
    """A list of layer specs (first match wins) plus the tensor-parallel size they are meant for."""

    tp_size: int = 1
    layer_specs: list[TPLayerSpec] = field(default_factory=list)
    use_default_specs: bool = False

    def find_matching_spec(self, param_name: str, model_type: str | None = None) -> TPLayerSpec | None:
        return next((s for s in self.layer_specs if s.matches(param_name, model_type)), None)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> AutoTPConfig:
        """From the ``partition_config`` JSON shape (``layer_specs``, ``use_default_specs``)."""
        specs = [TPLayerSpec(patterns=list(s["patterns"]), partition_type=s.get("partition_type", "column"),
                             shape=s.get("shape"), partition_dim=s.get("partition_dim"),
                             model_types=s.get("model_types"), gather_output=bool(s.get("gather_output", False)),
                             grad_allreduce=bool(s.get("grad_allreduce", False)))
                 for s in config.get("layer_specs", [])]
        return cls(tp_size=int(config.get("tp_size", 1)), layer_specs=specs,
                   use_default_specs=bool(config.get("use_default_specs", False)))


def merge_autotp_configs(base: AutoTPConfig, override: AutoTPConfig) -> AutoTPConfig:
    """``override``'s specs first (they win), then ``base``'s."""
    return AutoTPConfig(tp_size=override.tp_size if override.tp_size > 1 else base.tp_size,
                        layer_specs=list(override.layer_specs) + list(base.layer_specs),
                        use_default_specs=override.use_default_specs)


def _spec(kind: str, *patterns: str, shape: Sequence[Any] | None = None, dim: int | None = None) -> TPLayerSpec:
    return TPLayerSpec(patterns=list(patterns), partition_type=PartitionType(kind), shape=shape, partition_dim=dim)


_ATTN_O = r".*\.self_attn\.o_proj\.weight$"
_ATTN_QKV = r".*\.self_attn\.[qkv]_proj\.weight$"
_MLP_DOWN = r".*\.mlp\.down_proj\.weight$"
_MLP_UP = r".*\.mlp\.(up|gate)_proj\.weight$"


def _fused_qkv_specs(qkv_shape: list[int] | None = None, up_shape: list[int] | None = None) -> list[TPLayerSpec]:
    """BLOOM / ChatGLM layout: ``self_attention.query_key_value`` and ``mlp.dense_h_to_4h`` split by columns
    (as blocks of ``qkv_shape`` / ``up_shape`` on dim 0 when given), ``dense`` and ``dense_4h_to_h`` by rows."""
    return [_spec("row", r".*\.self_attention\.dense\.weight$"),
            _spec("column", r".*\.self_attention\.query_key_value\.weight$", shape=qkv_shape,
                  dim=0 if qkv_shape else None),
            _spec("row", r".*\.mlp\.dense_4h_to_h\.weight$"),
            _spec("column", r".*\.mlp\.dense_h_to_4h\.weight$", shape=up_shape, dim=0 if up_shape else None)]


class AutoTPPresets:
    """Layer specs of the documented model families (``preset_model``)."""

    @staticmethod
    def llama() -> AutoTPConfig:
        return AutoTPConfig(layer_specs=[_spec("row", _ATTN_O), _spec("column", _ATTN_QKV),
                                         _spec("row", _MLP_DOWN), _spec("column", _MLP_UP)])

    qwen2 = llama

    @staticmethod
    def bloom() -> AutoTPConfig:
        # BLOOM's fused QKV interleaves heads ([q1 k1 v1 q2 ...]), so a plain head split keeps whole heads.
        return AutoTPConfig(layer_specs=_fused_qkv_specs())

    @staticmethod
    def chatglm() -> AutoTPConfig:
        return AutoTPConfig(layer_specs=_fused_qkv_specs(qkv_shape=[3, -1], up_shape=[2, -1]))

    @staticmethod
    def mixtral() -> AutoTPConfig:
        return AutoTPConfig(layer_specs=[
            _spec("row", _ATTN_O), _spec("column", _ATTN_QKV),
            _spec("row", r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"),
            _spec("column", r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"),
            _spec("skip", r".*\.block_sparse_moe\.gate\.weight$")])

    @staticmethod
    def deepseek_v2() -> AutoTPConfig:
        return AutoTPConfig(layer_specs=[
            _spec("row", _ATTN_O),
            _spec("skip", r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"),
            _spec("column", r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"),
            _spec("row", r".*\.mlp\.experts\.\d+\.down_proj\.weight$"),
            _spec("column", r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$"),
            _spec("skip", r".*\.mlp\.gate\.weight$"),
            _spec("row", r".*\.mlp\.shared_experts\.down_proj\.weight$"),
            _spec("column", r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$"),
            _spec("row", _MLP_DOWN), _spec("column", _MLP_UP)])

    @staticmethod
    def phi3() -> AutoTPConfig:
        return AutoTPConfig(layer_specs=[
            _spec("row", _ATTN_O), _spec("column", r".*\.self_attn\.qkv_proj\.weight$", shape=[3, -1], dim=0),
            _spec("row", _MLP_DOWN), _spec("column", r".*\.mlp\.gate_up_proj\.weight$", shape=[2, -1], dim=0)])

    @staticmethod
    def get_preset(model_type: str) -> AutoTPConfig | None:
        """The preset for a ``model.config.model_type`` (case-insensitive), or None."""
        presets = {"llama": AutoTPPresets.llama, "bloom": AutoTPPresets.bloom, "chatglm": AutoTPPresets.chatglm,
                   "mixtral": AutoTPPresets.mixtral, "deepseek_v2": AutoTPPresets.deepseek_v2,
                   "qwen2": AutoTPPresets.qwen2, "phi3": AutoTPPresets.phi3}
        build = presets.get(str(model_type).lower())
        return build() if build else None


# Hugging Face tp_plan styles AutoTP builds (``colwise_rep`` is the older name of ``colwise_gather_output``;
# transformers adds ``embedding_rowwise`` for the input embedding of many models)
SUPPORTED_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "replicated_with_grad_allreduce",
                    "embedding_rowwise")


def check_styles(plan: Mapping[str, str]) -> None:
    """Reject a plan holding any style AutoTP does not build: applying only the supported entries could shard one
    half of a column/row pair (say ``o_proj`` by rows while the ``q_proj`` feeding it stays whole)."""
    unsupported = sorted({str(s) for s in plan.values() if str(s).lower() not in SUPPORTED_STYLES})
    if unsupported:
        raise ValueError(f"Hugging Face tp_plan contains unsupported partition style(s): {unsupported} (accepted: "
                         f"{', '.join(SUPPORTED_STYLES)}); the plan is rejected as a whole: give "
                         "tensor_parallel.partition_config for this model instead")


def style_spec(pattern: str, style: str) -> TPLayerSpec:
    """The layer spec of one tp_plan entry: ``pattern`` (a regex) sharded as ``style`` (checked by
    :func:`check_styles`)."""
    style = str(style).lower()
    if style.startswith("colwise"):
        return TPLayerSpec(patterns=[pattern], partition_type=PartitionType.COLUMN,
                           gather_output=style != "colwise")
    if style == "rowwise":
        return TPLayerSpec(patterns=[pattern], partition_type=PartitionType.ROW)
    if style == "embedding_rowwise":
        return TPLayerSpec(patterns=[pattern], partition_type=PartitionType.SKIP, vocab_parallel=True)
    return TPLayerSpec(patterns=[pattern], partition_type=PartitionType.SKIP, grad_allreduce=True)


def hf_tp_plan_specs(plan: Mapping[str, str] | None) -> list[TPLayerSpec] | None:
    """Layer specs from a Hugging Face ``base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise"}``).

    The styles of :data:`SUPPORTED_STYLES` are supported; any other style rejects the whole plan. None for an empty
    plan. Unlike ``TPPlanConverter`` (DeepSpeed's converter, whose rules match weights only and whose ``*`` spans
    dots), a ``*`` here stands for one name component and a rule matches the bias too.
    """
    if not plan:
        return None
    check_styles(plan)
    specs = []
    for pattern, style in plan.items():
        body = re.escape(pattern).replace(r"\*", r"[^.]+")
        specs.append(style_spec(rf"(^|.*\.){body}\.(weight|bias)$", style))
    return specs

"""Putting a parameter's tensor-parallel slices back together by the client's ``universal_checkpoint_info``
(DeepSpeed's rules: AutoTP and Megatron-DeepSpeed describe their layouts this way).

``universal_checkpoint_info`` holds parameter-name regex lists, each saying how matching parameters were split:
``tp_replicated_parameter_patterns`` (every rank holds the whole tensor: keep one copy, the copies must agree),
``parameter_to_average_patterns`` (average the copies), ``parameter_with_row_parallelism_patterns`` (split
along dim 1, the others along dim 0), ``parameter_with_2_sub_params_cat_dim_0`` (two fused halves split one by
one), ``parameter_with_sub_params`` (fused sub-parameters, :class:`SubparamShape`, split one by one, with the
per-rank widths of each under ``sub_param_shard_widths`` from version 0.4 on: uneven key/value heads) and
``vocabulary_parameter_patterns`` (embeddings whose TP padding is stripped to ``original_vocab_size``).
:class:`MergeRules` applies them to in-memory slices; :func:`merge_tp_slices` is DeepSpeed's front end over a
folder of ZeRO fragments (``<slice_dir>/<name>/<tp rank>/<state>.<dp rank>``, flat tensors).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepspeed.checkpoint.constants import (
    CAT_DIM,
    ORIGINAL_VOCAB_SIZE,
    PARAM,
    PARAM_N_SUB_PARAMS,
    PARAMETER_TO_AVERAGE_PATTERNS,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    SUB_PARAM_SHAPE,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    VOCAB_TENSOR,
    VOCABULARY_PARAMETER_PATTERNS,
)
from deepspeed.checkpoint.universal_checkpoint import (
    SHARD_WIDTHS_VERSION,
    SubparamShape,
    UniversalLayoutError,
    check_widths,
    even_widths,
)

MERGED_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UniversalLayoutError(message)


def _resolve_placeholder(shape: list[int], numel: int, name: str) -> list[int]:
    """``shape`` with its one ``-1`` entry (if any) set so that it holds ``numel`` elements."""
    holes = [i for i, d in enumerate(shape) if d < 0]
    if not holes:
        return shape
    _require(len(holes) == 1, f"sub-parameter shape {shape} of {name} has {len(holes)} placeholder dimensions")
    known = math.prod(d for d in shape if d >= 0)
    _require(known > 0 and numel % known == 0, f"sub-parameter shape {shape} of {name} cannot hold {numel} elements")
    return [numel // known if d < 0 else d for d in shape]


class MergeRules:
    """The merge rules of one ``universal_checkpoint_info``; ``unmatched`` keeps the patterns no merged
    parameter has matched yet (a strict conversion refuses patterns that match nothing: a misspelt rule)."""

    def __init__(self, uc_info: Mapping[str, Any]) -> None:
        self.info = uc_info
        self.version = float(uc_info.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
        self.replicated = list(uc_info.get(TP_REPLICATED_PARAMETER_PATTERNS, []))
        self.average = list(uc_info.get(PARAMETER_TO_AVERAGE_PATTERNS, []))
        self.row = list(uc_info.get(PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, []))
        self.vocab = list(uc_info.get(VOCABULARY_PARAMETER_PATTERNS, []))
        self.halves = list(uc_info.get(PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0, []))
        self.sub_params = [SubparamShape(**entry) for entry in uc_info.get(PARAMETER_WITH_SUB_PARAMS, [])]
        self.widths = dict(uc_info.get(SUB_PARAM_SHARD_WIDTHS, {}))
        self.unmatched = set(self.replicated + self.average + self.row + self.vocab + self.halves)
        self.unmatched.update(p for shape in self.sub_params for p in shape.patterns)

    def _match(self, patterns: Sequence[str], name: str) -> str | None:
        found = [p for p in patterns if re.match(p, name)]
        _require(len(found) <= 1, f"parameter {name} matches more than one pattern of a rule: {found}")
        if found:
            self.unmatched.discard(found[0])
        return found[0] if found else None

    def _sub_param_shape(self, name: str) -> tuple[SubparamShape | None, str | None]:
        for shape in self.sub_params:
            for pattern in shape.patterns:
                if re.match(pattern, name):
                    self.unmatched.discard(pattern)
                    return shape, pattern
        return None, None

    def merge(self, name: str, slices: Sequence[torch.Tensor]) -> dict[str, Any]:
        """The universal file's dict (``param`` and how it was merged) of one state from the ranks' ``slices``
        (each at its rank's shape, in rank order)."""
        out: dict[str, Any] = {}
        sub_shape, sub_pattern = self._sub_param_shape(name)
        if self._match(self.replicated, name):
            _require(all(s.equal(slices[0]) for s in slices[1:]),
                     f"{name} is tensor-parallel replicated but its copies on the ranks differ")
            param = slices[0]
        elif self._match(self.average, name):
            param = sum(slices) / len(slices)
        elif self._match(self.halves, name):
            halves = [s.chunk(2, dim=0) for s in slices]
            param = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
            out[CAT_DIM], out[PARAM_N_SUB_PARAMS] = 0, 2
        elif sub_shape is not None:
            param, out[SUB_PARAM_SHAPE] = self._merge_sub_params(name, sub_shape, sub_pattern, slices)
        else:
            dim = 1 if self._match(self.row, name) else 0
            param = torch.cat(list(slices), dim=dim)
            out[CAT_DIM] = dim
        if self._match(self.vocab, name):  # the rows past the real vocabulary are TP padding
            param = param[:self.info[ORIGINAL_VOCAB_SIZE], :]
            out[VOCAB_TENSOR] = True
        out[PARAM] = param
        return out

    def _sizes_and_widths(self, name: str, shape: SubparamShape, pattern: str,
                          slices: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], list, SubparamShape]:
        """(sub-parameter widths, per-rank widths of each, the shape with widths spelt out)."""
        dim, spec, tp = shape.partition_dim, shape.shape[shape.partition_dim], len(slices)
        if self.version >= SHARD_WIDTHS_VERSION:  # the head counts deciding the widths are not in the checkpoint
            _require(pattern in self.widths, f"Universal checkpoint version {self.version} records no "
                                             f"{SUB_PARAM_SHARD_WIDTHS} for {name}, whose pattern {pattern} "
                                             "declares sub-parameters")
            _require(isinstance(spec, (tuple, list)), f"{name}: version {self.version} metadata gives the "
                                                      f"sub-parameter count {spec!r}, not their widths")
            return tuple(spec), self.widths[pattern], shape
        if isinstance(spec, (tuple, list)):
            sizes = tuple(spec)
        else:  # older metadata: the entry is the count of equal sub-parameters, e.g. (3, -1) for fused QKV
            _require(all(s.dim() > dim for s in slices),
                     f"{name}: legacy sub-parameter metadata needs the ranks' slice shapes, the slices are flat")
            total = sum(s.shape[dim] for s in slices)
            _require(spec > 0 and total % spec == 0,
                     f"{name}: {spec} equal sub-parameters do not divide its dimension {dim} of {total}")
            sizes = (total // spec,) * spec
            spelt = list(shape.shape)
            spelt[dim] = sizes
            shape = SubparamShape(patterns=list(shape.patterns), shape=tuple(spelt), partition_dim=dim)
        return sizes, even_widths(sizes, tp), shape

    def _merge_sub_params(self, name: str, shape: SubparamShape, pattern: str,
                          slices: Sequence[torch.Tensor]) -> tuple[torch.Tensor, SubparamShape]:
        dim = shape.partition_dim
        sizes, widths, shape = self._sizes_and_widths(name, shape, pattern, slices)
        check_widths(sizes, widths, len(slices), name)
        logical = [sum(d) if isinstance(d, (tuple, list)) else int(d) for d in shape.shape]
        logical[dim] = sum(sizes)
        # resolved from the whole parameter: a rank owning none of it has an empty slice that cannot infer a -1
        logical = _resolve_placeholder(logical, sum(s.numel() for s in slices), name)
        views = []
        for rank, piece in enumerate(slices):
            rank_shape = list(logical)
            rank_shape[dim] = sum(w[rank] for w in widths)
            _require(math.prod(rank_shape) == piece.numel(), f"tp rank {rank} of {name} holds {piece.numel()} "
                                                             f"elements, its shard widths make {tuple(rank_shape)}")
            views.append(piece.reshape(rank_shape))
        offsets, merged = [0] * len(views), []
        for per_rank in widths:
            merged.append(torch.cat([v.narrow(dim, offsets[r], per_rank[r]) for r, v in enumerate(views)], dim=dim))
            offsets = [o + w for o, w in zip(offsets, per_rank, strict=True)]
        normalized = SubparamShape(patterns=list(shape.patterns), shape=tuple(shape.shape), partition_dim=dim)
        return torch.cat(merged, dim=dim), normalized


def read_tp_slices(param_dir: str, state: str, tp_degree: int,
                   slice_shapes: Sequence[Any] | None = None) -> list[Any]:
    """Each tensor-parallel rank's ``state`` of one parameter from its ZeRO fragments
    (``<param_dir>/<tp>/<state>.<dp>``, concatenated in data-parallel order), reshaped to ``slice_shapes[tp]``
    when given. A rank without fragments owns none of the parameter: with shapes it gets an empty tensor of its
    (empty) shape, so later ranks keep their positions; ``step`` is one value, the ranks' common one."""
    slices, gaps = [], []
    pattern = re.compile(rf"^{re.escape(state)}\.(\d+)$")
    for tp in range(tp_degree):
        folder = os.path.join(param_dir, str(tp))
        found = sorted((int(m.group(1)), m.group(0)) for m in map(pattern.match, sorted(os.listdir(folder)))
                       if m) if os.path.isdir(folder) else []
        if not found:
            gaps.append((tp, len(slices)))
            continue
        shards = [torch.load(os.path.join(folder, file), weights_only=False) for _, file in found]
        if state == "step":
            _require(all(v == shards[0] for v in shards), f"{folder}: the data-parallel ranks' step values differ")
            slices.append(shards[0])
            continue
        merged = torch.cat(shards, dim=0)
        slices.append(merged if slice_shapes is None else merged.reshape(tuple(slice_shapes[tp])))
    if gaps and slice_shapes is not None and slices and torch.is_tensor(slices[0]):
        for tp, position in reversed(gaps):
            shape = tuple(slice_shapes[tp])
            _require(math.prod(shape) == 0, f"{param_dir}: no fragment files for tp rank {tp}, whose recorded shape "
                                            f"{shape} is not empty")
            slices.insert(position, torch.empty(shape, dtype=slices[0].dtype))
    return slices


def merge_tp_slices(uc_info: Mapping[str, Any], dir: str, slice_dir: str, tp_degree: int,  # noqa: A002
                    name_and_shapes: tuple[str, Sequence[Any] | None]) -> set[str]:
    """Write ``<dir>/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` of one parameter from its fragments under
    ``<slice_dir>/<name>/`` (``name_and_shapes``: the name and each TP rank's slice shape); returns the
    patterns of ``uc_info`` this parameter did not match."""
    from deepspeed.checkpoint._conversion import _save
    from deepspeed.runtime.checkpointing.atomic import make_dirs

    name, shapes = name_and_shapes
    source, target = os.path.join(slice_dir, name), os.path.join(dir, name)
    rules = MergeRules(uc_info)
    make_dirs(target)
    steps = read_tp_slices(source, "step", tp_degree, shapes)
    if steps:
        _save(os.path.join(target, "step.pt"), steps[0])
    for state in MERGED_STATES:
        slices = read_tp_slices(source, state, tp_degree, shapes)
        if slices:  # an optimizer without Adam's moments has no such fragments
            _save(os.path.join(target, f"{state}.pt"), rules.merge(name, slices))
    return rules.unmatched


def group_per_tp_shapes(shapes_by_file: Sequence[Mapping[str, Any]], pp_degree: int,
                        tp_degree: int) -> dict[str, list[Any]]:
    """``{name: [shape on tp rank 0, 1, ...]}`` from each model-states file's ``{name: shape}``, the files in
    DeepSpeed's pipeline-major order (file ``pp * tp_degree + tp``). A parameter only some pipeline stages hold is
    kept; one several stages hold (a tied weight) must have one shape on each TP rank (None: a rank without it)."""
    _require(len(shapes_by_file) == pp_degree * tp_degree, f"{len(shapes_by_file)} model-states files for "
                                                           f"pp_degree {pp_degree} x tp_degree {tp_degree}")
    per_tp: list[dict[str, Any]] = []
    for tp in range(tp_degree):
        merged: dict[str, Any] = {}
        for pp in range(pp_degree):
            stage = shapes_by_file[pp * tp_degree + tp]
            for name in merged.keys() & stage.keys():
                _require(merged[name] == stage[name], f"Pipeline replicas of {name} on tp rank {tp} disagree on "
                                                      f"shape: {merged[name]} vs {stage[name]}")
            merged.update(stage)
        per_tp.append(merged)
    names = sorted(set().union(*per_tp)) if per_tp else []
    return {name: [shapes.get(name) for shapes in per_tp] for name in names}

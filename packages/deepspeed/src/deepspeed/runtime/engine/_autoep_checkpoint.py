"""AutoEP checkpoints in DeepSpeed's layout, so they load onto any ``autoep_size``.

- The model-states file lists the AutoEP layers under ``ds_autoep_layers`` (module order: ``moe_layer_id``,
  ``module_path``, ``num_experts``, ``num_local_experts``, ``ep_size``, ``expert_key_prefix``, the saving rank's
  ``ep_rank`` and expert range) and carries ``universal_checkpoint_info`` with the expert parameter patterns, which
  ``ds_to_universal`` reads to put the experts of all expert-parallel ranks back together
  (``deepspeed.checkpoint.autoep_universal``).
- ``layer_<l>_expert_<e>_mp_rank_XX_model_states.pt``: global expert ``e`` of the ``l``-th AutoEP layer as
  ``<prefix>.w1|w2|w3.<e>`` (one row of each fused weight), written by the first rank of each expert-data-parallel
  group. The model-states file keeps every other weight. A load reads its own expert-parallel rank's experts, so
  the weights load at any ``autoep_size`` dividing ``num_experts``; ZeRO's optimizer shards load onto the same
  layout only, a Universal Checkpoint onto any.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed.checkpoint.autoep_universal import EXPERT_WEIGHT_NAMES
from deepspeed.checkpoint.constants import (
    AUTOEP_LAYERS_KEY,
    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY,
    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION,
    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY,
    AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT,
    EXPERT_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)
from deepspeed.runtime.checkpointing import CheckpointError, ShardContext
from deepspeed.runtime.checkpointing.checks import content_error
from ds_zero.checkpoint import EXPERT_ROWS_ATTR  # (ep_rank, ep_size): the rows a universal load cuts

EXPERT_PATTERN = r".*\.experts\.w[123]$"
REQUIRED_FIELDS = ("moe_layer_id", "module_path", "num_experts", "num_local_experts", "ep_size", "expert_key_prefix")


def autoep_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    from ds_moe.autoep.layer import AutoEPMoELayer

    return [(name, sub) for name, sub in module.named_modules() if isinstance(sub, AutoEPMoELayer)]


def _prefix(name: str) -> str:
    return f"{name}.experts" if name else "experts"


def validate_autoep_layers(layers: Any, where: str) -> list[dict[str, Any]]:
    """A checkpoint's ``ds_autoep_layers``: a list of dicts with the required fields and distinct layer ids."""
    if not isinstance(layers, list):
        raise CheckpointError(f"{where}: ds_autoep_layers metadata is malformed: expected list, got "
                              f"{type(layers).__name__}")
    seen = set()
    for entry in layers:
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: ds_autoep_layers entry is malformed: expected dict, got "
                                  f"{type(entry).__name__}")
        missing = sorted(set(REQUIRED_FIELDS) - entry.keys())
        if missing:
            raise CheckpointError(f"{where}: ds_autoep_layers entry is invalid: missing fields {missing}")
        if entry["moe_layer_id"] in seen:
            raise CheckpointError(f"{where}: ds_autoep_layers metadata has duplicate moe_layer_id: "
                                  f"{entry['moe_layer_id']}")
        seen.add(entry["moe_layer_id"])
    return layers


class AutoEPCheckpointShards:
    """The checkpoint extension of an engine whose model has AutoEP layers."""

    owns_optimizer_state = False
    owns_module_state = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.layers = autoep_layers(engine.module)
        if len({layer.ep_size for _, layer in self.layers}) > 1:
            raise CheckpointError("AutoEP checkpointing needs one autoep_size for every AutoEP layer, found "
                                  f"{sorted({layer.ep_size for _, layer in self.layers})}")
        for _, layer in self.layers:
            for param in layer.experts.parameters():
                setattr(param, EXPERT_ROWS_ATTR, (layer.ep_rank, layer.ep_size))
        # ZeRO-3: the experts are partitions over their expert-data-parallel group, saved in every rank's ZeRO
        # files like any other partitioned parameter (no per-expert files)
        self.zero3 = getattr(engine, "zero3_scheduler", None) is not None

    def _entries(self) -> list[dict[str, Any]]:
        from ds_moe import groups

        entries = []
        for layer_id, (name, layer) in enumerate(self.layers):
            first = layer.ep_rank * layer.num_local_experts
            group = layer.ep_group_name
            edp = ((groups._get_expert_data_parallel_rank(group), groups._get_expert_data_parallel_world_size(group))
                   if group in groups._get_expert_parallel_group_dict() else (0, 1))
            entries.append({"moe_layer_id": layer_id, "module_path": name, "num_experts": layer.num_experts,
                            "num_local_experts": layer.num_local_experts, "ep_size": layer.ep_size,
                            "expert_key_prefix": _prefix(name), **self._format(),
                            "ep_group_name": layer.ep_group_name, "ep_rank": layer.ep_rank,
                            "expert_data_parallel_rank": edp[0], "expert_data_parallel_world_size": edp[1],
                            "global_expert_start": first, "global_expert_end": first + layer.num_local_experts})
        return entries

    def _format(self) -> dict[str, Any]:
        if self.zero3:
            return {AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY: AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT,
                    AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY: AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION}
        return {"expert_state_format": "per_expert_files"}

    def model_state_extras(self) -> dict[str, Any]:
        entries = self._entries()
        info = dict(getattr(self.engine.module, UNIVERSAL_CHECKPOINT_INFO, None) or {})
        info.setdefault(UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE)
        info[EXPERT_PARAMETER_PATTERNS] = [EXPERT_PATTERN]
        info[AUTOEP_LAYERS_KEY] = entries
        return {AUTOEP_LAYERS_KEY: entries, UNIVERSAL_CHECKPOINT_INFO: info}

    def strip_module_state(self, weights: dict[str, Any]) -> dict[str, Any]:
        if self.zero3:  # partitioned like every other weight: the ZeRO-3 files hold them
            return weights
        fused = {f"{_prefix(name)}.{w}" for name, _ in self.layers for w in EXPERT_WEIGHT_NAMES}
        return {k: v for k, v in weights.items() if k not in fused}

    def files_to_save(self, ctx: ShardContext) -> dict[str, Any]:
        from ds_moe import groups

        files: dict[str, Any] = {}
        if self.zero3:
            return files
        mp = ctx.parallel.mp_rank
        folding = self._folding()
        for layer_id, (name, layer) in enumerate(self.layers):
            group = layer.ep_group_name
            if folding is not None:
                if not self._folded_expert_writer(folding):
                    continue
            elif group in groups._get_expert_parallel_group_dict() and groups._get_expert_data_parallel_rank(group):
                continue  # one writer per expert-data-parallel group
            first = layer.ep_rank * layer.num_local_experts
            for local in range(layer.num_local_experts):
                files[f"layer_{layer_id}_expert_{first + local}_mp_rank_{mp:02d}_model_states.pt"] = {
                    f"{_prefix(name)}.{w}.{first + local}": getattr(layer.experts, w)[local].detach().clone()
                    for w in EXPERT_WEIGHT_NAMES}
        return files

    def complete_module_state(self, weights: dict[str, Any], load: Callable[[str], Any]) -> dict[str, Any]:
        """Stack this rank's experts (by global id) from the per-expert files into the fused weights."""
        mp = self.engine.checkpoint_mp_rank
        if self.zero3:
            return weights
        # the expert layout first: a model with another expert count is told so, not that a file is missing
        name = f"mp_rank_{mp:02d}_model_states.pt"
        saved = getattr(load, "mapped", load)(name).get(AUTOEP_LAYERS_KEY)
        if saved is not None:
            self.check_saved_layers(validate_autoep_layers(saved, name), name)
        layout = self._expected_layout(mp)
        for layer_id, (name, layer) in enumerate(self.layers):
            if all(f"{_prefix(name)}.{w}" in weights for w in EXPERT_WEIGHT_NAMES):
                continue  # saved with the fused weights in the model states (same autoep_size only)
            weights.update(stacked_experts(
                layer, name, lambda e, i=layer_id: f"layer_{i}_expert_{e}_mp_rank_{mp:02d}_model_states.pt", load,
                layout=layout))
        return weights

    def _folding(self) -> Any:
        """The ``ParallelFoldingSpec`` when AutoEP is folded onto AutoTP (tensor-parallel size > 1), else None."""
        spec = getattr(self.engine, "_autoep_folding_spec", None)
        return spec if spec is not None and getattr(spec, "tp_size", 1) > 1 else None

    @staticmethod
    def _folded_expert_writer(spec: Any) -> bool:
        """Folded: a rank at tensor-parallel rank ``t`` and expert-parallel rank ``r`` loads its experts from the
        files named ``mp_rank_<t>``, so one file per (``t``, ``r``) pair present in the layout must exist
        (DeepSpeed: every rank whose dense data-parallel rank is below ``ep_size`` writes). The pairs are
        (stage rank mod ``tp``, stage rank mod ``ep``); the first ``lcm(tp, ep)`` ranks of the stage hold each
        pair exactly once, so they write, each file once."""
        return dist.get_rank() % spec.stage_size < math.lcm(spec.tp_size, spec.ep_size)

    def _expected_layout(self, mp: int) -> str:
        """Where this rank's per-expert files come from, for the error a missing one raises."""
        spec = self._folding()
        if spec is None:
            return (f"per-expert files named by model-parallel rank {mp}, written by the first rank of each "
                    "expert-data-parallel group")
        return (f"AutoEP folded onto AutoTP (tp_size={spec.tp_size}, ep_size={spec.ep_size}): one file per expert "
                f"and tensor-parallel rank, this rank reads tensor-parallel rank {mp}'s files (written by the first "
                f"lcm(tp_size, ep_size)={math.lcm(spec.tp_size, spec.ep_size)} ranks of each stage; a checkpoint "
                "saved before this layout has only the first expert-data-parallel rank's files)")

    def load_files(self, ctx: ShardContext, load: Callable[[str], Any]) -> None:
        self.prepare_load(ctx, load)()

    def prepare_load(self, ctx: ShardContext, load: Callable[[str], Any]) -> Callable[[], None]:
        """Check the saved ``ds_autoep_layers`` against this model (the weights come through complete_module_state)."""
        name = f"mp_rank_{ctx.parallel.mp_rank:02d}_model_states.pt"
        if self.zero3:  # ZeRO-3 writes a model-states file per data-parallel rank
            name = f"zero_pp_rank_0_{name}"
        saved = load(name).get(AUTOEP_LAYERS_KEY)
        if saved is not None:
            self.check_saved_layers(validate_autoep_layers(saved, name), name)
        return lambda: None

    def prepare_universal(self, ctx: ShardContext, load: Callable[[str], Any]) -> Callable[[], None]:
        """A Universal Checkpoint's experts come through the optimizer's universal load (rows cut by ep rank)."""
        return self.prepare_load(ctx, load)

    def universal_reader(self, inner: Callable[[str], Any]) -> Callable[[str], Any]:
        """Before any parameter of a Universal Checkpoint is read: its expert tensors must split into this model's
        local experts (``ValueError`` naming ``target_local_experts`` and ``checkpoint_local_experts``, as
        DeepSpeed's ZeRO-3 load does), so a model with another expert count is told that, not a router's shape."""
        from ds_zero.checkpoint import UNIVERSAL_ZERO

        tag_dir = getattr(inner, "tag_dir", None)
        for name, layer in self.layers:
            for w in EXPERT_WEIGHT_NAMES:
                rel = os.path.join(UNIVERSAL_ZERO, f"{_prefix(name)}.{w}", "fp32.pt")
                if tag_dir is not None and not os.path.isfile(os.path.join(tag_dir, rel)):
                    continue  # the optimizer's universal load names missing folders
                try:
                    saved = inner(rel)
                except FileNotFoundError:
                    continue
                value = saved.get("param") if isinstance(saved, dict) else saved
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue  # the optimizer's universal load names a file without a tensor
                total = int(saved.get("ep_num_experts", value.shape[0])) if isinstance(saved, dict) else value.shape[0]
                if total % layer.ep_size:
                    raise ValueError(f"{rel}: AutoEP universal expert tensor cannot be split over the target "
                                     f"expert-parallel ranks: checkpoint_num_experts={total}, "
                                     f"target_ep_size={layer.ep_size}")
                if total // layer.ep_size != layer.num_local_experts:
                    raise ValueError(f"{rel}: AutoEP universal expert tensor is incompatible with this model's "
                                     f"layer {name!r}: target_local_experts={layer.num_local_experts}, "
                                     f"checkpoint_local_experts={total // layer.ep_size} (checkpoint_num_experts="
                                     f"{total}, model num_experts={layer.num_experts}, ep_size={layer.ep_size})")
        return inner

    def check_saved_layers(self, saved: list[dict[str, Any]], where: str) -> None:
        now = {_prefix(name): layer.num_experts for name, layer in self.layers}
        then = {entry["expert_key_prefix"]: entry["num_experts"] for entry in saved}
        if then != now:
            detail = ""
            for name, layer in self.layers:
                total = then.get(_prefix(name))
                if isinstance(total, int) and total != layer.num_experts:
                    local = (f"checkpoint_local_experts={total // layer.ep_size}" if total % layer.ep_size == 0
                             else f"checkpoint_num_experts={total} not divisible by ep_size={layer.ep_size}")
                    detail = (f"; AutoEP layer {name!r}: target_local_experts={layer.num_local_experts}, {local} "
                              f"(checkpoint num_experts={total}, this model's {layer.num_experts}, "
                              f"ep_size={layer.ep_size})")
                    break
            raise AutoEPLayoutError(f"{where}: saved AutoEP layers (expert prefix -> num_experts) {then} differ "
                                    f"from this model's {now}{detail}")


class AutoEPLayoutError(CheckpointError, ValueError):
    """A checkpoint saved with another AutoEP expert layout than the model loading it (a ``ValueError`` as in
    DeepSpeed, and a ``CheckpointError``)."""


def _torch_load(path: str, map_location: Any = None) -> Any:
    return torch.load(path, map_location=map_location, weights_only=True)


def load_moe_state_dict(checkpoint_path: str, tag: Any, state_dict: dict[str, Any], old_moe_load: bool,
                        model: torch.nn.Module | None = None, mpu: Any = None, num_experts: Any = 1,
                        checkpoint_engine: Any = None, autoep_layers: Any = None, folding_spec: Any = None,
                        checkpoint_mp_rank: int | None = None) -> None:
    """DeepSpeed's ``DeepSpeedEngine.load_moe_state_dict``: add this rank's experts from the per-expert files of
    ``<checkpoint_path>/<tag>`` to ``state_dict`` (native MoE layers: renamed to their local ids; AutoEP layers:
    stacked into the fused ``<prefix>.w1|w2|w3``). ``autoep_layers`` (the checkpoint's ``ds_autoep_layers``) is
    checked first; ``old_moe_load``: the legacy ``layer_-1`` files, which AutoEP models cannot use."""
    from ds_moe import groups
    from ds_moe.layer import MoE

    if folding_spec is not None:
        raise ValueError("load_moe_state_dict: AutoEP+AutoTP folding (folding_spec) is not supported by this build")
    if checkpoint_mp_rank is None:
        checkpoint_mp_rank = 0 if mpu is None else mpu.get_model_parallel_rank()
    read = checkpoint_engine.load if checkpoint_engine is not None else _torch_load
    tag_dir = os.path.join(checkpoint_path, str(tag))

    def name(layer_id: int, expert: int) -> str:
        return os.path.join(tag_dir, f"layer_{layer_id}_expert_{expert}_mp_rank_{checkpoint_mp_rank:02d}"
                                     "_model_states.pt")

    has_autoep = model is not None and bool(autoep_layers_of_model(model))
    if old_moe_load:
        if has_autoep:
            raise RuntimeError("Legacy checkpoint format (old_moe_load) is incompatible with AutoEP layers; convert "
                               "the checkpoint with ds_to_universal first")
        group = groups._get_max_expert_size_name()
        total = max(num_experts) if isinstance(num_experts, (list, tuple)) else num_experts
        local_count = total // groups._get_expert_parallel_world_size(group)
        first = groups._get_expert_data_parallel_rank(group) * local_count  # DeepSpeed's legacy numbering
        for local in range(local_count):
            state_dict.update(_renamed(read(name(-1, first + local), map_location=torch.device("cpu")),
                                       first + local, local))
        return
    if autoep_layers is not None:
        validate_autoep_layers(autoep_layers, tag_dir)
    if model is None:
        return
    layer_id = 0
    for module_name, module in model.named_modules():
        if isinstance(module, MoE):
            first = groups._get_expert_parallel_rank(module.expert_group_name) * module.num_local_experts
            for local in range(module.num_local_experts):
                state_dict.update(_renamed(read(name(layer_id, first + local), map_location=torch.device("cpu")),
                                           first + local, local))
            layer_id += 1
        elif type(module).__name__ == "AutoEPMoELayer":
            state_dict.update(stacked_experts(module, module_name, lambda e, i=layer_id: name(i, e),
                                              lambda path: read(path, map_location=torch.device("cpu"))))
            layer_id += 1


def stacked_experts(layer: Any, module_name: str, path_of: Callable[[int], str],
                    load: Callable[[str], Any], layout: str | None = None) -> dict[str, torch.Tensor]:
    """The fused ``<prefix>.w1|w2|w3`` of this rank's experts of ``layer``, stacked from the per-expert files
    (``path_of(global expert id)``, read by ``load``). A missing file raises ``FileNotFoundError`` naming it, the
    expert, this rank's expert-parallel position and ``layout`` (what the load expected)."""
    first, prefix = layer.ep_rank * layer.num_local_experts, _prefix(module_name)
    rows: dict[str, list[torch.Tensor]] = {w: [] for w in EXPERT_WEIGHT_NAMES}
    for e in range(first, first + layer.num_local_experts):
        path = path_of(e)
        try:
            saved = load(path)
        except FileNotFoundError as exc:
            full = getattr(exc, "filename", None) or path
            reason = (f"missing (the file does not exist): AutoEP expert {e} of layer {module_name!r} for this "
                      f"rank's expert-parallel rank {layer.ep_rank} of ep_size {layer.ep_size}; expected layout: "
                      f"{layout or 'per-expert files named by model-parallel rank'}")
            error = FileNotFoundError(errno.ENOENT, f"AutoEP expert checkpoint file not found: {reason}", full)
            error.checkpoint_path, error.reason = full, reason  # type: ignore[attr-defined]
            raise error from exc
        for w in EXPERT_WEIGHT_NAMES:
            key = f"{prefix}.{w}.{e}"
            if not isinstance(saved, dict) or key not in saved:
                raise content_error(path, f"missing key {key!r}: not expert {e} of AutoEP layer {module_name!r} "
                                    "(saved from another model or num_experts?)")
            rows[w].append(saved[key])
    return {f"{prefix}.{w}": torch.stack(rows[w]) for w in EXPERT_WEIGHT_NAMES}


def autoep_layers_of_model(model: torch.nn.Module) -> list[tuple[str, Any]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == "AutoEPMoELayer"]


def _renamed(expert_state: dict[str, Any], global_id: int, local_id: int) -> dict[str, Any]:
    marker = ".deepspeed_moe.experts.deepspeed_experts."
    return {key.replace(f"{marker}{global_id}", f"{marker}{local_id}"): value for key, value in expert_state.items()}

"""MoE checkpoints in DeepSpeed's layout: one file per expert, so they load onto any ``ep_size``.

- ``layer_<l>_expert_<e>_mp_rank_XX_model_states.pt``: global expert ``e`` of the ``l``-th MoE layer (module order),
  keys as in the model's state dict with the global expert id; written by the first rank of each expert-data-parallel
  group. The model-states file keeps every other weight (``strip_module_state``) and ``num_experts`` per layer.
- ``expp_rank_<r>_mp_rank_XX_optim_states.pt``: ``{"optimizer": ...}`` of expert-parallel rank ``r`` (stage 0; ZeRO
  writes its own shards). Each expert rank's optimizer holds different experts' state, so it loads onto the same
  ``ep_size`` only; with another one, ``load_optimizer_states=False`` restores the weights, schedule and counters.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch

from deepspeed.runtime.checkpointing import CheckpointError, ShardContext
from deepspeed.runtime.checkpointing.checks import content_error
from deepspeed.runtime.checkpointing.serialize import compact_for_save

_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


def _moe_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    from ds_moe.layer import MoE

    return [(name, sub) for name, sub in module.named_modules() if isinstance(sub, MoE)]


class MoECheckpointShards:
    """The checkpoint extension of an engine whose model has ``deepspeed.moe`` layers."""

    owns_module_state = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        # stage 0 keeps the optimizer per expert rank; ZeRO's own shards already are per rank
        self.owns_optimizer_state = engine.optimizer is not None and engine.zero_optimization_stage() == 0

    def _layers(self) -> list[tuple[int, str, Any]]:
        return [(i, name, moe) for i, (name, moe) in enumerate(_moe_layers(self.engine.module))]

    def model_state_extras(self) -> dict[str, Any]:
        layers = self._layers()
        return {"num_experts": [moe.num_experts for _, _, moe in layers],
                "moe_ep_sizes": [moe.ep_size for _, _, moe in layers]}

    def strip_module_state(self, weights: dict[str, Any]) -> dict[str, Any]:
        prefixes = [f"{name}{_EXPERTS}" if name else _EXPERTS.lstrip(".") for _, name, _ in self._layers()]
        return {k: v for k, v in weights.items() if not any(k.startswith(p) for p in prefixes)}

    def files_to_save(self, ctx: ShardContext) -> dict[str, Any]:
        from ds_moe import groups

        files: dict[str, Any] = {}
        mp = ctx.parallel.mp_rank
        for layer_id, name, moe in self._layers():
            group = moe.expert_group_name
            if groups._get_expert_data_parallel_rank(group) != 0:
                continue
            first = groups._get_expert_parallel_rank(group) * moe.num_local_experts
            for local, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                prefix = f"{name}{_EXPERTS}{first + local}." if name else f"{_EXPERTS.lstrip('.')}{first + local}."
                files[f"layer_{layer_id}_expert_{first + local}_mp_rank_{mp:02d}_model_states.pt"] = {
                    prefix + key: value.detach().clone() for key, value in expert.state_dict().items()}
        if self.owns_optimizer_state:
            name = groups._get_max_expert_size_name()
            if groups._get_expert_data_parallel_rank(name) == 0:
                rank = groups._get_expert_parallel_rank(name)
                files[f"expp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"] = {
                    "optimizer": compact_for_save(self.engine.optimizer.state_dict())}
        return files

    def complete_module_state(self, weights: dict[str, Any], load: Callable[[str], Any]) -> dict[str, Any]:
        """Add this rank's experts (by global id, renamed to the local ids) to the saved shared weights."""
        from ds_moe import groups

        mp = self.engine.checkpoint_mp_rank
        for layer_id, name, moe in self._layers():
            first = groups._get_expert_parallel_rank(moe.expert_group_name) * moe.num_local_experts
            head = f"{name}{_EXPERTS}" if name else _EXPERTS.lstrip(".")
            for local in range(moe.num_local_experts):
                saved = load(f"layer_{layer_id}_expert_{first + local}_mp_rank_{mp:02d}_model_states.pt")
                pattern = re.compile(rf"^{re.escape(head)}{first + local}\.")
                weights.update({pattern.sub(f"{head}{local}.", key): value for key, value in saved.items()})
        return weights

    def load_files(self, ctx: ShardContext, load: Callable[[str], Any]) -> None:
        self.prepare_load(ctx, load)()

    def prepare_load(self, ctx: ShardContext, load: Callable[[str], Any]) -> Callable[[], None]:
        """Read and check this expert rank's optimizer file (stage 0) before anything loads; the step restores it."""
        if not self.owns_optimizer_state or not ctx.load_optimizer_states or ctx.load_module_only:
            return lambda: None
        from ds_moe import groups

        saved = load(f"mp_rank_{ctx.parallel.mp_rank:02d}_model_states.pt").get("moe_ep_sizes")
        now = [moe.ep_size for _, _, moe in self._layers()]
        if saved is not None and list(saved) != now:
            raise CheckpointError(f"{ctx.tag_dir}: saved with expert-parallel sizes {list(saved)}, this model uses "
                                  f"{now}: each expert rank's optimizer state holds its own experts, so it loads "
                                  "onto the same ep_size only; pass load_optimizer_states=False to load the weights, "
                                  "schedule and counters")
        rank = groups._get_expert_parallel_rank(groups._get_max_expert_size_name())
        # named through the engine's method, as DeepSpeed does (clients and DeepSpeed's tests patch it)
        name = os.path.basename(self.engine._get_optimizer_ckpt_name(*os.path.split(ctx.tag_dir), rank))
        state = load(name)
        if not isinstance(state, dict) or "optimizer" not in state:
            raise content_error(os.path.join(ctx.tag_dir, name), "missing key 'optimizer': not an expert-parallel "
                                "optimizer-states file")
        return lambda: self.engine.optimizer.load_state_dict(state["optimizer"])

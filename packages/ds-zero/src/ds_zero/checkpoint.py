"""ZeRO stage 1/2 files in a training checkpoint (a ``CheckpointShards`` extension of the engine's checkpointing).

Every data-parallel rank writes ``zero_pp_rank_<r>_mp_rank_XX_optim_states.pt`` = ``{"optimizer_state_dict":
<its partitioned optimizer state>, "ds_config": ..., "ds_version": ...}`` and the model-states file gets
DeepSpeed's ``param_shapes`` / ``frozen_param_shapes`` / ``frozen_param_fragments`` / ``shared_params``, which
is what ``zero_to_fp32`` reads. Rank 0 also copies the standalone ``zero_to_fp32.py`` script into the save
folder (beside ``latest``). Loading onto the saved world size reads this rank's file; onto another one,
every saved rank's file, and the partitions are cut again (see ``_state``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

OPTIMIZER_STATE_DICT = "optimizer_state_dict"


def optim_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def shared_params(module: torch.nn.Module) -> dict[str, str]:
    """Tied parameters: every name after the first -> the first name of the same tensor."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


class ZeroCheckpointShards:
    """The engine's checkpoint extension for a ``DeepSpeedZeroOptimizer`` (``owns_optimizer_state``)."""

    owns_optimizer_state = True

    def __init__(self, optimizer: Any, module: torch.nn.Module, ds_config: Mapping[str, Any],
                 ds_version: str) -> None:
        self.optimizer = optimizer
        self.module = module
        self.ds_config = dict(ds_config)
        self.ds_version = ds_version

    def model_state_extras(self) -> Mapping[str, Any]:
        frozen = {name: p for name, p in self.module.named_parameters() if not p.requires_grad}
        return {
            "param_shapes": [OrderedDict((name, p.shape) for name, p in zip(fg.names, fg.params, strict=True))
                             for fg in self.optimizer.groups],
            "frozen_param_shapes": {name: p.shape for name, p in frozen.items()} or None,
            "frozen_param_fragments": {name: p.detach().clone() for name, p in frozen.items()} or None,
            "shared_params": shared_params(self.module),
        }

    def files_to_save(self, ctx: Any) -> Mapping[str, Any]:
        name = optim_states_name(ctx.parallel.dp_rank, ctx.parallel.mp_rank)
        return {name: {OPTIMIZER_STATE_DICT: self.optimizer.state_dict(), "ds_config": self.ds_config,
                       "ds_version": self.ds_version}}

    def files_to_copy(self, ctx: Any) -> Mapping[str, str]:
        """``{name in the save dir: source file}`` copied by the first rank: the ``zero_to_fp32.py`` script, next
        to ``latest`` as DeepSpeed places it (``cd <save_dir>; python zero_to_fp32.py . out/``)."""
        if ctx.parallel.global_rank != 0:
            return {}
        from ds_zero import zero_to_fp32

        return {"zero_to_fp32.py": os.path.abspath(zero_to_fp32.__file__)}

    def load_files(self, ctx: Any, load: Callable[[str], Any]) -> None:
        if ctx.load_module_only or not ctx.load_optimizer_states:
            return
        mp_rank = ctx.parallel.mp_rank
        first_name = optim_states_name(0, mp_rank)
        first = _optimizer_state(load(first_name), first_name)
        counts = first.get("partition_count", 1)
        saved_world = max(counts) if isinstance(counts, list) else int(counts)
        names = [optim_states_name(r, mp_rank) for r in range(saved_world)]
        # every rank checks every file before loading anything, so all ranks fail together rather than some
        # of them waiting in the weight gather for a rank that raised
        missing = [n for n in names if not os.path.isfile(os.path.join(ctx.tag_dir, n))]
        if missing:
            raise FileNotFoundError(f"ZeRO checkpoint {ctx.tag_dir} was saved by {saved_world} data-parallel ranks "
                                    f"but {missing} are missing; the checkpoint is incomplete (load another tag)")
        if saved_world == ctx.parallel.dp_world_size:
            own = names[ctx.parallel.dp_rank]
            self.optimizer.load_state_dict(first if own == first_name else _optimizer_state(load(own), own))
            return
        states = [first] + [_optimizer_state(load(n), n) for n in names[1:]]
        self.optimizer.load_state_dict(states)


def _optimizer_state(obj: Any, name: str) -> dict[str, Any]:
    if not isinstance(obj, dict) or OPTIMIZER_STATE_DICT not in obj:
        found = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{name} is not a ZeRO optimizer-states file (no '{OPTIMIZER_STATE_DICT}'; found {found})")
    return obj[OPTIMIZER_STATE_DICT]

"""Progressive Layer Dropping in the engine: with ``progressive_layer_drop.enabled`` every training forward gets
``progressive_layer_drop=True`` and ``pld_theta`` (the schedule's keep probability after ``global_steps`` steps)
as keyword arguments, as DeepSpeed's engine passes them; the model decides which layers to skip. A model whose
forward does not take them fails with Python's own TypeError, as under DeepSpeed. Eval forwards get nothing."""

from __future__ import annotations

import weakref
from typing import Any

from deepspeed.runtime.progressive_layer_drop import ProgressiveLayerDrop


def attach(engine: Any, config: Any) -> None:
    """Set ``engine.progressive_layer_drop`` (None when disabled) and add the keywords with a forward pre-hook."""
    section = config.progressive_layer_drop
    engine.progressive_layer_drop = None
    if not section.enabled:
        return
    pld = ProgressiveLayerDrop(theta=section.theta, gamma=section.gamma)
    engine.progressive_layer_drop = pld
    engine_ref = weakref.ref(engine)  # the hook lives on the module; it must not keep the engine alive

    def add_pld_state(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        owner = engine_ref()
        if owner is None or not module.training:
            return None
        pld.update_state(owner.global_steps)
        return args, {**kwargs, **pld.get_state()}

    engine.module.register_forward_pre_hook(add_pld_state, with_kwargs=True)

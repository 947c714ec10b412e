"""``unwrap_model_for_generation``: a ZeRO-3 model with every parameter gathered once, for ``generate()``.

Generation calls the model token by token; ZeRO-3's per-module hooks would gather and release every layer's
weights at each token. Inside the block the weights stay gathered and the hooks are off; on exit the hooks are
back and the weights are partitioned again (unchanged: the block is for inference, no modifier rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ds_zero.zero3 import GatheredParameters


def _hooked_scheduler(engine: Any) -> Any:
    scheduler = getattr(engine, "zero3_scheduler", None)
    return scheduler if scheduler is not None and scheduler.hook_handles else None


@contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield ``model`` (a DeepSpeed engine, or a plain module) with its ZeRO-3 parameters gathered and the
    gather hooks removed; anything not under ZeRO-3 is yielded as is. Collective under ZeRO-3: every rank enters."""
    scheduler = _hooked_scheduler(model)
    if scheduler is None:
        with GatheredParameters(list(model.parameters())):
            yield model
        return
    with scheduler.hooks_removed(), GatheredParameters(list(model.parameters())):
        yield model

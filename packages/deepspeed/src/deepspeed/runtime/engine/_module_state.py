"""``engine.load_module_state_dict``: how a checkpoint's module weights go into the live model.

``load_checkpoint`` (``deepspeed.runtime.checkpointing``) calls this method on the engine instead of
``module.load_state_dict``, so a subclass or client that overrides it (as DeepSpeed's own pipeline engine and
several trainers do) decides how the weights load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_zero.zero3 import GatheredParameters, ZeroParamStatus, is_partitioned


def _released(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The ZeRO-3 parameters among ``params`` whose full value is not on this rank now."""
    return [p for p in params if is_partitioned(p) and p.ds_status is ZeroParamStatus.NOT_AVAILABLE]


def _check_allowance(load_result: Any, allowed_missing_keys: Iterable[str]) -> None:
    missing = sorted(set(load_result.missing_keys) - set(allowed_missing_keys))
    unexpected = sorted(load_result.unexpected_keys)
    if missing or unexpected:
        raise RuntimeError("load_module_state_dict: the checkpoint's module state does not match the model outside "
                           f"AutoEP expert parameters (allowed_missing_keys): missing={missing}, "
                           f"unexpected={unexpected}")


class ModuleStateMethods:
    """The engine's module-weight loading (mixed into ``DeepSpeedEngine``)."""

    module: torch.nn.Module

    def load_module_state_dict(self, checkpoint: dict[str, Any], strict: bool = True,
                               custom_load_fn: Callable[..., Any] | None = None, fetch_z3_params: bool = False,
                               z3_params_to_fetch: Iterable[torch.nn.Parameter] | None = None,
                               allowed_missing_keys: Iterable[str] | None = None) -> None:
        """Load ``checkpoint["module"]`` into ``self.module``.

        ``custom_load_fn(src=state_dict, dst=module)`` replaces ``load_state_dict``. ZeRO-3: the released
        parameters among ``z3_params_to_fetch`` (or all of the module's with ``fetch_z3_params``) are gathered for
        the load and rank 0's loaded values become every rank's partitions (collective over their groups).
        ``allowed_missing_keys`` (AutoEP experts restored from ZeRO shards) only loosens a strict load: those keys
        may be absent, any other missing or unexpected key raises RuntimeError; ``strict=False`` stays non-strict.
        """
        if not isinstance(checkpoint, dict) or "module" not in checkpoint:
            raise TypeError("load_module_state_dict: checkpoint must be a model-states dict with a 'module' entry, "
                            f"got {type(checkpoint).__name__}"
                            + (f" with keys {sorted(map(str, checkpoint))[:8]}" if isinstance(checkpoint, dict)
                               else ""))
        if z3_params_to_fetch is not None:
            to_fetch = _released(z3_params_to_fetch)
        elif fetch_z3_params:
            to_fetch = _released(self.module.parameters())
        else:
            to_fetch = []
        allowance = None if allowed_missing_keys is None else list(allowed_missing_keys)
        weights = checkpoint["module"]
        with GatheredParameters(to_fetch, modifier_rank=0, enabled=bool(to_fetch)):
            if custom_load_fn is not None:
                custom_load_fn(src=weights, dst=self.module)
                return
            result = self.module.load_state_dict(weights, strict=strict and allowance is None)
            if strict and allowance is not None:
                _check_allowance(result, allowance)

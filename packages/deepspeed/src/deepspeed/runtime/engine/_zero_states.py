"""The engine methods that move the ZeRO optimizer's states off their devices and back (a mixin of
``DeepSpeedEngine``, over ``ds_zero.offload_states``), and the check that training calls make while states
are moved."""

from __future__ import annotations

from typing import Any


class ZeroStateMethods:
    """``DeepSpeedEngine``'s ``offload_states`` / ``reload_states`` and the checks around them."""

    optimizer: Any

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the ZeRO optimizer's states (``include``: ``OffloadStateTypeEnum`` members, default all) to
        ``device`` (CPU) until ``reload_states()``."""
        from ds_zero.offload_states import offload_states

        self._require_zero("offload_states")
        offload_states(self.optimizer, include=include, device=device, pin_memory=pin_memory,
                       non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move the states moved by ``offload_states`` back to their devices."""
        from ds_zero.offload_states import reload_states

        self._require_zero("reload_states")
        reload_states(self.optimizer, non_blocking=non_blocking)

    def _require_zero(self, call: str) -> None:
        if self.zero_optimization_stage() == 0 or self.optimizer is None:
            raise RuntimeError(f"engine.{call}() needs a ZeRO optimizer (zero_optimization.stage 1-3); this engine "
                               f"runs stage {self.zero_optimization_stage()}"
                               f"{'' if self.optimizer is not None else ' without an optimizer'}")

    def _require_states_in_place(self, call: str) -> None:
        """Training and loading need the states where the optimizer works on them."""
        if self.zero_optimization_stage() == 0:
            return
        from ds_zero.offload_states import offloaded

        moved = offloaded(self.optimizer)
        if moved:
            raise RuntimeError(f"engine.{call}: the ZeRO states {', '.join(s.value for s in moved)} were moved by "
                               "offload_states(); call engine.reload_states() first")

"""The engine methods that exist for ZeRO-3 (a mixin of ``DeepSpeedEngine``): releasing the gathered weights,
and consolidating the partitioned weights into one 16-bit state dict (for ``save_16bit_model`` and the Hugging
Face / Accelerate model save)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist


class Zero3EngineMethods:
    zero3_scheduler: Any
    module: torch.nn.Module

    def empty_partition_cache(self) -> None:
        """Release every gathered parameter, persistent ones included (they are gathered again when next used)."""
        if self.zero3_scheduler is not None:
            self.zero3_scheduler.release_all(include_persistent=True)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The whole model's weights (training dtype, on the CPU) and persistent buffers, gathered module by
        module so no rank ever holds more than one module's weights at a time beyond the result. Collective;
        rank 0 gets the state dict, the other ranks an empty one (as in DeepSpeed)."""
        from ds_zero.zero3 import GatheredParameters

        if self.zero3_scheduler is None:
            raise RuntimeError("_zero3_consolidated_16bit_state_dict: this engine does not run ZeRO stage 3 "
                               f"(stage {self.zero_optimization_stage()}); use module.state_dict()")
        keep = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        out: OrderedDict[str, Any] = OrderedDict()
        seen: dict[int, torch.Tensor] = {}
        for prefix, module in self.module.named_modules(remove_duplicate=False):
            prefix = f"{prefix}." if prefix else ""
            params = [p for p in module._parameters.values() if p is not None]
            with GatheredParameters(params):
                if not keep:
                    continue
                for name, p in module._parameters.items():
                    if p is None or (exclude_frozen_parameters and not p.requires_grad):
                        continue
                    if id(p) not in seen:
                        seen[id(p)] = p.detach().cpu().clone()
                    out[prefix + name] = seen[id(p)]
            if keep:
                for name, buf in module._buffers.items():
                    if buf is not None and name not in module._non_persistent_buffers_set:
                        out[prefix + name] = buf.detach().cpu().clone()
        return out

"""``DeepSpeedHybridEngine``: DeepSpeed-Chat's actor engine (``"hybrid_engine": {"enabled": true}``), which trains
like ``DeepSpeedEngine`` and generates with the same weights between training steps (RLHF's experience phase).

Generation goes through the wrapped module's own ``generate`` (``engine.module.generate`` and ``engine.generate``
are the same call, as in DeepSpeed, which rebinds the module's). Under ZeRO-3 the partitioned weights are gathered
once for the whole call and held until it returns, instead of being gathered and released module by module at
every decoding step; afterwards the gathered copies are released and training goes on from the partitions.
DeepSpeed's inference-kernel swap (its fused transformer kernels, the LoRA fusion into them, CUDA graphs and
tensor-parallel generation over ``inference_tp_size`` ranks) is not built: the module's own layers run, LoRA
layers included, so the tokens are the ones the trained weights give (``ds_config.unbuilt.INERT_KEYS`` warns for
the keys that would change what DeepSpeed does).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed.runtime.engine import DeepSpeedEngine


class DeepSpeedHybridEngine(DeepSpeedEngine):
    """A training engine whose module also generates, with ZeRO-3's weights gathered once per generation."""

    inference_mp_group = None  # DeepSpeed's attribute; tensor-parallel generation is not built

    def __init__(self, model: torch.nn.Module, config: Any, **kwargs: Any) -> None:
        super().__init__(model, config, **kwargs)
        self._generate_latency = 0.0
        self._generate = getattr(self.module, "generate", None)
        if self._generate is not None:
            self.module.generate = self.generate  # DeepSpeed-Chat calls engine.module.generate

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped module's ``generate(*inputs, **kwargs)``, its weights whole for the whole call."""
        if self._generate is None:
            raise AttributeError(f"{type(self.module).__name__} has no generate(); the hybrid engine generates "
                                 "through the wrapped module's own generate (e.g. a Hugging Face model)")
        start = time.perf_counter()
        if self.zero3_scheduler is None:
            out = self._generate(*inputs, **kwargs)
        else:
            out = self._generate_gathered(*inputs, **kwargs)
        self._generate_latency = time.perf_counter() - start
        return out

    def _generate_gathered(self, *inputs: Any, **kwargs: Any) -> Any:
        with self.gathered_for_generation():
            return self._generate(*inputs, **kwargs)

    @contextlib.contextmanager
    def gathered_for_generation(self) -> Iterator[None]:
        """The module's weights whole for the block: under ZeRO-3 every weight gathered once and held, the
        per-module hooks off meanwhile (they would release them); a no-op otherwise. Decoding loops that call
        the module directly (``runtime.rollout``) run inside it."""
        if self.zero3_scheduler is None:
            yield
            return
        from deepspeed.runtime.zero import GatheredParameters

        with self.zero3_scheduler.hooks_removed(), GatheredParameters(list(self.module.parameters())):
            yield

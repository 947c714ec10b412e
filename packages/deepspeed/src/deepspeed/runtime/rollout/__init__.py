"""``deepspeed.runtime.rollout``: on-policy generation for RL and distillation trainers.

``RolloutEngine`` is the interface (``RolloutRequest`` in, ``RolloutBatch`` out, per-call ``SamplingConfig``);
``HybridEngineRollout`` generates with the training engine's own module (the hybrid engine's weights, gathered
once per call under ZeRO-3); ``build_rollout`` picks the engine named by a ``RolloutConfig``; ``opsd`` has the
on-policy distillation targets (``ResponseTokenBatch``) and loss (``generalized_jsd_loss``).
"""

from __future__ import annotations

import warnings
from typing import Any

from deepspeed.runtime.rollout.base import (
    RolloutBatch,
    RolloutConfig,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
)
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout
from deepspeed.runtime.rollout.opsd import JSDLossOutput, ResponseTokenBatch, generalized_jsd_loss

__all__ = [
    "HybridEngineRollout", "JSDLossOutput", "ResponseTokenBatch", "RolloutBatch", "RolloutConfig", "RolloutEngine",
    "RolloutRequest", "SamplingConfig", "build_rollout", "generalized_jsd_loss",
]

_ENGINES = ("hybrid_engine", )


def build_rollout(rollout_cfg: Any, student_engine: Any = None, tokenizer: Any = None,
                  **kwargs: Any) -> RolloutEngine:
    """The rollout engine ``rollout_cfg.engine`` names (a ``RolloutConfig`` or anything with ``engine``).

    ``"hybrid_engine"`` needs the DeepSpeed engine wrapping the model being trained (``student_engine``) and its
    Hugging Face tokenizer.
    """
    if kwargs:
        warnings.warn(f"build_rollout ignores {sorted(kwargs)}: no rollout engine takes them", stacklevel=2)
    name = getattr(rollout_cfg, "engine", None)
    if name == "hybrid_engine":
        if student_engine is None or tokenizer is None:
            raise ValueError("hybrid_engine rollout needs both student_engine (the DeepSpeed engine of the model "
                             f"being trained) and tokenizer; got student_engine={student_engine!r}, "
                             f"tokenizer={tokenizer!r}")
        return HybridEngineRollout(engine=student_engine, tokenizer=tokenizer, cfg=rollout_cfg)
    raise ValueError(f"Unknown rollout engine {name!r} (rollout_cfg.engine); choose from {', '.join(_ENGINES)}")

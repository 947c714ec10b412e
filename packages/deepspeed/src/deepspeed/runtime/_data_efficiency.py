"""Data efficiency in the engine: the legacy ``curriculum_learning`` schedule (``curriculum_seqlen`` passed to the
model's forward, as DeepSpeed's engine does) and the random-LTD token schedule (``data_efficiency.data_routing``).

Both are updated in ``forward`` from the engine's step counter, as DeepSpeed does (the curriculum with
``global_steps + 1``, random-LTD with ``global_steps``), so a resumed run recomputes them from the restored counter.
"""

from __future__ import annotations

from typing import Any


class DataEfficiency:
    """The schedules one engine runs (``None`` each when its section is off)."""

    def __init__(self, config: Any, global_batch: int, micro_batch: int) -> None:
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
        from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

        cl = config.curriculum_learning
        self.curriculum = CurriculumScheduler(cl) if cl.enabled else None
        self.seqlen = self.curriculum is not None and cl.curriculum_type == "seqlen"
        ltd = config.data_efficiency.data_routing.random_ltd
        self.random_ltd_config = None
        self.random_ltd = None
        if ltd.enabled:
            self.random_ltd_config = ltd.model_dump(exclude_none=True) | {"global_batch_size": global_batch,
                                                                          "micro_batch_size": micro_batch}
            self.random_ltd = RandomLTDScheduler(self.random_ltd_config)

    def before_forward(self, global_steps: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Advance the schedules for this training forward; the kwargs with ``curriculum_seqlen`` added."""
        if self.curriculum is not None:
            self.curriculum.update_difficulty(global_steps + 1)
            if self.seqlen:
                kwargs = {**kwargs, "curriculum_seqlen": self.curriculum.get_current_difficulty()}
        if self.random_ltd is not None:
            self.random_ltd.update_seq(global_steps)
        return kwargs


def build(config: Any, global_batch: int, micro_batch: int) -> DataEfficiency | None:
    """The engine's data-efficiency schedules, or None when neither section is enabled (the common case)."""
    if not (config.curriculum_learning.enabled or config.data_efficiency.data_routing.random_ltd.enabled):
        return None
    return DataEfficiency(config, global_batch, micro_batch)

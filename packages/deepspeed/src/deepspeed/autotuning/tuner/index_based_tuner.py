"""Tuners that walk the space by index: in order (grid search) or in a seeded random order."""

from __future__ import annotations

import random
from typing import Any

from deepspeed.autotuning.tuner.base_tuner import BaseTuner


class GridSearchTuner(BaseTuner):
    """Every configuration, in the order the tuning space lists them."""

    def next_batch(self, sample_size: int = 1) -> list[dict]:
        batch, self.all_exps = self.all_exps[:sample_size], self.all_exps[sample_size:]
        return batch


class RandomTuner(BaseTuner):
    """Configurations in random order (``seed`` makes the order reproducible)."""

    def __init__(self, exps: list[dict], resource_manager: Any, metric: str, seed: int | None = None) -> None:
        super().__init__(exps, resource_manager, metric)
        self.rng = random.Random(seed)

    def next_batch(self, sample_size: int = 1) -> list[dict]:
        picked = self.rng.sample(range(len(self.all_exps)), min(sample_size, len(self.all_exps)))
        batch = [self.all_exps[i] for i in picked]
        self.all_exps = [e for i, e in enumerate(self.all_exps) if i not in set(picked)]
        return batch

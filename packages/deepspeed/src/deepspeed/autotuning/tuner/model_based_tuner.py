"""A tuner that measures a few configurations, fits a cost model to them and runs the predicted best next."""

from __future__ import annotations

import math
import random
from typing import Any

from deepspeed.autotuning.constants import DS_CONFIG, METRIC_LATENCY
from deepspeed.autotuning.scheduler import ExperimentResult
from deepspeed.autotuning.tuner.base_tuner import BaseTuner
from deepspeed.autotuning.tuner.cost_model import RidgeCostModel
from deepspeed.autotuning.utils import flatten, get_tuning_keys

INIT_NUM = 2
"""Configurations measured (picked at random) before the cost model is first fitted."""
RANDOM_EXPLORATION_RATIO = 0.2
"""Share of picks made at random instead of by the model, so one bad early fit cannot trap the search."""


def feature_vector(ds_config: dict, keys: list[str]) -> list[float]:
    """The tuned values of ``ds_config`` as numbers: booleans 0/1, sizes on a log2 scale (buckets span decades)."""
    flat = flatten(ds_config)
    out = []
    for key in keys:
        value = flat.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out.append(float(bool(value)))
        else:
            out.append(math.log2(value) if value > 0 else float(value))
    return out


class ModelBasedTuner(BaseTuner):
    """Explores ``exps`` of ``tuning_space``: ``INIT_NUM`` random picks, then the cost model's best unvisited
    prediction (a random pick with probability ``RANDOM_EXPLORATION_RATIO``). Failed experiments count as the
    worst measured score."""

    def __init__(self, exps: list[dict], resource_manager: Any, metric: str, tuning_space: dict,
                 seed: int | None = 0) -> None:
        super().__init__(exps, resource_manager, metric)
        self.tuning_space = tuning_space
        self.rng = random.Random(seed)
        tuned = set(get_tuning_keys(tuning_space))
        flat_keys = sorted({k for e in self.all_exps for k in flatten(e[DS_CONFIG])})
        # flattened keys ("zero_optimization_reduce_bucket_size") of the tuned leaves ("reduce_bucket_size")
        self.feature_keys = [k for k in flat_keys if any(k == t or k.endswith("_" + t) for t in tuned)]
        self.features = [feature_vector(e[DS_CONFIG], self.feature_keys) for e in self.all_exps]
        self.visited: set[int] = set()
        self.index_of = {e["name"]: i for i, e in enumerate(self.all_exps)}
        self.cost_model = RidgeCostModel()
        self.evaluated: list[tuple[list[float], float | None]] = []

    def has_next(self) -> bool:
        return len(self.visited) < len(self.all_exps)

    def _unvisited(self) -> list[int]:
        return [i for i in range(len(self.all_exps)) if i not in self.visited]

    def _pick(self) -> int:
        left = self._unvisited()
        if len(self.visited) < INIT_NUM or not self.cost_model.fitted or self.rng.random() < RANDOM_EXPLORATION_RATIO:
            return self.rng.choice(left)
        scores = self.cost_model.predict([self.features[i] for i in left])
        return left[max(range(len(left)), key=scores.__getitem__)]

    def next_batch(self, sample_size: int = 1) -> list[dict]:
        batch = []
        while len(batch) < sample_size and self.has_next():
            index = self._pick()
            self.visited.add(index)
            batch.append(self.all_exps[index])
        return batch

    def update(self, results: list[ExperimentResult]) -> None:
        """Add the results (as higher-is-better scores) and refit the cost model."""
        for result in results:
            value = result.value(self.metric)
            score = None if value is None else (-value if self.metric.lower() == METRIC_LATENCY else value)
            index = self.index_of.get(result.name)
            features = self.features[index] if index is not None else feature_vector(result.exp[DS_CONFIG],
                                                                                     self.feature_keys)
            self.evaluated.append((features, score))
        measured = [s for _, s in self.evaluated if s is not None]
        if not measured:
            return
        worst = min(measured) - 0.5 * (abs(min(measured)) + 1e-12)
        self.cost_model.fit([f for f, _ in self.evaluated], [worst if s is None else s for _, s in self.evaluated])


"""The tuning loop shared by every search strategy: pick a batch, run it, remember the best, maybe stop early."""

from __future__ import annotations

import abc
import logging
from typing import Any

from deepspeed.autotuning.scheduler import ExperimentResult, is_better

logger = logging.getLogger("deepspeed.autotuning")


class BaseTuner(abc.ABC):
    """Explores ``exps`` (experiment descriptions) with ``resource_manager`` (anything with
    ``run(exps) -> [ExperimentResult]``), ranking by ``metric`` (``latency``: lower is better; ``throughput``,
    ``flops``: higher is better)."""

    def __init__(self, exps: list[dict], resource_manager: Any, metric: str) -> None:
        self.all_exps = list(exps)
        self.rm = resource_manager
        self.metric = metric or "throughput"
        self.best_iter = 0
        self.best_exp: dict | None = None
        self.best_metric_val: float | None = None
        self.results: list[ExperimentResult] = []
        logger.info("tuner %s: %d experiments in the space", type(self).__name__, len(self.all_exps))

    def has_next(self) -> bool:
        """Whether configurations remain to evaluate."""
        return bool(self.all_exps)

    @abc.abstractmethod
    def next_batch(self, sample_size: int) -> list[dict]:
        """Remove and return the next (at most ``sample_size``) experiments to run."""

    def update(self, results: list[ExperimentResult]) -> None:
        """Learn from finished ``results`` (nothing for the index-based tuners)."""
        return None

    def tune(self, sample_size: int = 1, n_trials: int = 1000, early_stopping: int | None = None) -> int:
        """Run experiments until the space is exhausted, ``n_trials`` ran, or ``early_stopping`` experiments
        passed without beating the best. Returns the number of experiments run."""
        ran = 0
        while ran < n_trials and self.has_next():
            batch = self.next_batch(min(sample_size, n_trials - ran))
            if not batch:
                break
            results = self.rm.run(batch)
            for result in results:
                ran += 1
                self.results.append(result)
                value = result.value(self.metric)
                if is_better(value, self.best_metric_val, self.metric):
                    self.best_exp, self.best_metric_val, self.best_iter = result.exp, value, ran
            self.update(results)
            if early_stopping and ran >= self.best_iter + early_stopping:
                logger.info("tuner stopped early after %d experiments: the best (%s) was experiment %d",
                            ran, self.best_exp["name"] if self.best_exp else None, self.best_iter)
                break
        return ran

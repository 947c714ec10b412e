"""ZenFlow's schedule in steps, from ``zero_optimization.zenflow``, and the options this version cannot honour.

See ``ds_zero.zenflow.optimizer`` for what happens at each kind of step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ds_config import ConfigProblem

__all__ = ["ZenFlowPlan", "unsupported"]


@dataclass(frozen=True)
class ZenFlowPlan:
    """The schedule in steps: ``select_interval`` 0 selects only once, after the warm-up."""

    topk_ratio: float
    select_interval: int
    update_interval: int
    full_warm_up_rounds: int = 0
    offload: bool = False
    epoch_interval: int = 0
    """Epochs between selections for the 'epoch'/'auto' strategies (0: ``select_interval`` counts steps)."""

    @classmethod
    def from_config(cls, cfg: Any) -> ZenFlowPlan:
        """From a ``ZenFlowConfig`` whose ``update_interval`` is an integer (the engine checks that)."""
        interval = 1 if cfg.select_strategy == "auto" else int(cfg.select_interval)
        plan = cls(float(cfg.topk_ratio), interval, int(cfg.update_interval), int(cfg.full_warm_up_rounds),
                   bool(cfg.offload))
        if cfg.select_strategy == "step":
            return plan
        # 'auto' means once per epoch; until the epoch length is known (for_epoch_length), select once
        plan = replace(plan, select_interval=0, epoch_interval=interval)
        return plan.for_epoch_length(cfg.steps_per_epoch) if cfg.steps_per_epoch else plan

    def for_epoch_length(self, steps_per_epoch: int) -> ZenFlowPlan:
        """The plan once an epoch is known to take ``steps_per_epoch`` steps (the training dataloader's length)."""
        if not self.epoch_interval:
            return self
        return replace(self, select_interval=self.epoch_interval * int(steps_per_epoch))

    def selects_at(self, t: int) -> bool:
        w, s = self.full_warm_up_rounds, self.select_interval
        return t == w or (t > w and s > 0 and t % s == 0)

    def updates_at(self, t: int) -> bool:
        w, s = self.full_warm_up_rounds, self.select_interval
        return t + 1 < w or (t + 1 - w) % self.update_interval == 0 or (s > 0 and (t + 1) % s == 0)


def unsupported(config: Any) -> list[ConfigProblem]:
    """What a ZeRO stage 1/2 config with ``zero_optimization.zenflow`` asks for that ZenFlow here cannot do,
    each naming the key, the value and what is accepted."""
    zero = config.zero_optimization
    zf = zero.zenflow
    if zf is None:
        return []
    where = "zero_optimization.zenflow"
    problems = []
    off = zero.offload_optimizer
    device = str(off.device).rsplit(".", 1)[-1] if off is not None else "none"
    if device != "cpu":  # DeepSpeed refuses it too: the unselected columns are what the CPU step updates
        problems.append(ConfigProblem("zero_optimization.offload_optimizer.device",
                                      "ZenFlow needs the optimizer offloaded to the CPU; accepted: cpu", device))
    if zf.update_interval == "auto":
        problems.append(ConfigProblem(f"{where}.update_interval", "the adaptive update interval ('auto', driven by "
                                      "auto_ratio) is not built; accepted: an integer >= 1", "auto"))
    if zf.overlap_step:
        problems.append(ConfigProblem(f"{where}.overlap_step", "the overlapped CPU optimizer process is not built; "
                                      "accepted: false", True))
    if zf.select_strategy == "auto" and zf.select_interval != "auto":  # DeepSpeed refuses it as well
        problems.append(ConfigProblem(f"{where}.select_interval", "select_strategy 'auto' re-selects once per "
                                      "epoch by itself; accepted: 'auto', or select_strategy 'step'/'epoch' with "
                                      "this interval", zf.select_interval))
    if config.fp16_enabled:
        problems.append(ConfigProblem("fp16.enabled", "ZenFlow's selective steps take unscaled gradients; "
                                      "accepted with ZenFlow: false (use bf16 or fp32)", True))
    return problems

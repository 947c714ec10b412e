"""``scheduler`` section: DeepSpeed's learning-rate schedules with their documented parameters.

The five DeepSpeed schedules (``deepspeed.runtime.lr_schedules``) get strict, typed ``params``; any other
``type`` names a ``torch.optim.lr_scheduler`` class and keeps an open ``params`` mapping.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from ds_config._base import DSConfigModel, KeepAuto
from ds_config._errors import ConfigError, ConfigProblem, did_you_mean
from ds_config._types import Auto, Bool, Float, Int, NonNeg, PosInt

AutoF = Annotated[Float | Auto, KeepAuto()]
AutoLr = Annotated[Float | list[Float] | Auto, KeepAuto()]
AutoPos = Annotated[PosInt | Auto, KeepAuto()]
AutoNonNeg = Annotated[NonNeg | Auto, KeepAuto()]
AutoB = Annotated[Bool | Auto, KeepAuto()]
AutoIter = Annotated[Int | Auto, KeepAuto()]
WarmupType = Annotated[Literal["log", "linear"] | Auto, KeepAuto()]

SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class LRRangeTestParams(DSConfigModel):
    """``LRRangeTest``: raise the learning rate at a fixed rate to find the largest stable one."""

    lr_range_test_min_lr: AutoLr = 0.001
    """Initial (lowest) learning rate, per parameter group when a list."""
    lr_range_test_step_size: AutoPos = 2000
    """Training steps between learning-rate increases."""
    lr_range_test_step_rate: AutoF = 1.0
    """Scaling rate of the range test."""
    lr_range_test_staircase: AutoB = False
    """Increase in steps rather than continuously."""
    last_batch_iteration: AutoIter = -1
    """Index of the last batch, for resuming (-1 starts from the beginning)."""


class OneCycleParams(DSConfigModel):
    """``OneCycle`` (1Cycle): one learning-rate/momentum cycle, then decay."""

    cycle_min_lr: AutoLr
    """Lower learning-rate boundary of the cycle (required)."""
    cycle_max_lr: AutoLr
    """Upper learning-rate boundary of the cycle (required)."""
    decay_lr_rate: AutoF = 0.0
    cycle_first_step_size: AutoPos = 2000
    """Steps in the increasing half of the cycle."""
    cycle_second_step_size: AutoNonNeg | None = None  # 0: no falling half (DeepSpeed accepts it)
    """Steps in the decreasing half; ``None`` means ``cycle_first_step_size``."""
    cycle_first_stair_count: AutoNonNeg = 0
    cycle_second_stair_count: AutoNonNeg | None = None
    decay_step_size: AutoNonNeg = 0
    """Steps between decays in the decay phase (0: no decay)."""
    cycle_momentum: AutoB = True
    cycle_min_mom: AutoLr = 0.8
    cycle_max_mom: AutoLr = 0.9
    decay_mom_rate: AutoF = 0.0
    last_batch_iteration: AutoIter = -1


class WarmupLRParams(DSConfigModel):
    """``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then stay there."""

    warmup_min_lr: AutoLr = 0.0
    warmup_max_lr: AutoLr | None = None
    """Peak learning rate; ``None`` (the signature's default) uses the optimizer's learning rate."""
    warmup_num_steps: AutoPos = 1000
    warmup_type: WarmupType = "log"
    """Shape of the warm-up curve: ``log`` or ``linear``."""
    last_batch_iteration: AutoIter = -1


class WarmupDecayLRParams(DSConfigModel):
    """``WarmupDecayLR``: warm up, then decay linearly to zero at ``total_num_steps``."""

    total_num_steps: AutoPos
    """Total training steps (required)."""
    warmup_min_lr: AutoLr = 0.0
    warmup_max_lr: AutoLr = 0.001
    warmup_num_steps: AutoPos = 1000
    warmup_type: WarmupType = "log"
    last_batch_iteration: AutoIter = -1


class WarmupCosineLRParams(DSConfigModel):
    """``WarmupCosineLR``: warm up to the optimizer's learning rate, then cosine decay."""

    total_num_steps: AutoPos
    """Total training steps (required)."""
    warmup_min_ratio: AutoF = 0.0
    """Warm-up start learning rate as a ratio of the optimizer's learning rate."""
    warmup_num_steps: AutoPos = 1000
    cos_min_ratio: AutoF = 0.0001
    """Final learning rate as a ratio of the optimizer's learning rate."""
    warmup_type: WarmupType = "log"
    last_batch_iteration: AutoIter = -1


class _Scheduler(DSConfigModel):
    def constructor_params(self) -> dict[str, Any]:
        """Constructor keyword arguments (documented defaults filled in for DeepSpeed's schedules)."""
        params = self.params
        return params.model_dump() if isinstance(params, DSConfigModel) else dict(params)


class LRRangeTestScheduler(_Scheduler):
    type: Literal["LRRangeTest"]
    params: LRRangeTestParams = Field(default_factory=LRRangeTestParams)


class OneCycleScheduler(_Scheduler):
    type: Literal["OneCycle"]
    params: OneCycleParams


class WarmupLRScheduler(_Scheduler):
    type: Literal["WarmupLR"]
    params: WarmupLRParams = Field(default_factory=WarmupLRParams)


class WarmupDecayLRScheduler(_Scheduler):
    type: Literal["WarmupDecayLR"]
    params: WarmupDecayLRParams


class WarmupCosineLRScheduler(_Scheduler):
    type: Literal["WarmupCosineLR"]
    params: WarmupCosineLRParams


class TorchScheduler(_Scheduler):
    """A ``torch.optim.lr_scheduler`` class named by ``type``; ``params`` go to its constructor unchecked."""

    type: str = Field(min_length=1, json_schema_extra={"not": {"enum": list(SCHEDULERS)}})
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _not_a_misspelt_schedule(self) -> TorchScheduler:
        lowered = {s.lower(): s for s in SCHEDULERS}
        if self.type.lower() in lowered:
            raise ConfigError(ConfigProblem("type", f"is spelt '{lowered[self.type.lower()]}' (scheduler names "
                                                    "are case-sensitive)", self.type))
        hint = did_you_mean(self.type, SCHEDULERS)
        if hint and self.type not in _TORCH_SCHEDULERS:
            raise ConfigError(ConfigProblem("type", f"unknown scheduler type{hint}; DeepSpeed schedules: "
                                                    f"{', '.join(SCHEDULERS)}, or a torch.optim.lr_scheduler "
                                                    "class name", self.type))
        return self


# Names in torch.optim.lr_scheduler that are close to a DeepSpeed schedule but legitimate.
_TORCH_SCHEDULERS = {"OneCycleLR", "CyclicLR", "LinearLR", "ConstantLR", "StepLR", "ExponentialLR", "LambdaLR",
                     "MultiStepLR", "CosineAnnealingLR", "PolynomialLR", "SequentialLR", "ChainedScheduler",
                     "ReduceLROnPlateau", "CosineAnnealingWarmRestarts", "MultiplicativeLR"}


def _scheduler_tag(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("type")
    else:
        kind = getattr(value, "type", None)
    return kind if kind in SCHEDULERS else "torch"


SchedulerConfig = Annotated[
    Annotated[LRRangeTestScheduler, Tag("LRRangeTest")]
    | Annotated[OneCycleScheduler, Tag("OneCycle")]
    | Annotated[WarmupLRScheduler, Tag("WarmupLR")]
    | Annotated[WarmupDecayLRScheduler, Tag("WarmupDecayLR")]
    | Annotated[WarmupCosineLRScheduler, Tag("WarmupCosineLR")]
    | Annotated[TorchScheduler, Tag("torch")],
    Discriminator(_scheduler_tag),
]
"""``scheduler``: ``{"type": ..., "params": {...}}``, validated per type."""

SCHEDULER_PARAMS: dict[str, type[DSConfigModel]] = {
    "LRRangeTest": LRRangeTestParams, "OneCycle": OneCycleParams, "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams, "WarmupCosineLR": WarmupCosineLRParams,
}

"""``optimizer`` section: the optimizer's type and its constructor parameters.

``params`` is typed but open: the documented parameters are checked (type, range), anything else is passed
through, because ``type`` may name any ``torch.optim`` optimizer. Every value may stay ``"auto"`` until Hugging
Face fills it in.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from ds_config._base import DSConfigModel, KeepAuto, UnknownConfigKeyWarning
from ds_config._errors import did_you_mean
from ds_config._types import Auto, Bool, Float, NonNeg

AutoF = Annotated[Float | Auto, KeepAuto()]
AutoNonNegF = Annotated[Annotated[Float, Field(ge=0)] | Auto, KeepAuto()]
AutoB = Annotated[Bool | Auto, KeepAuto()]
AutoI = Annotated[NonNeg | Auto, KeepAuto()]

# Optimizers DeepSpeed builds itself (matched case-insensitively, as DeepSpeed does); other names are looked
# up in torch.optim.
DEEPSPEED_OPTIMIZERS = ("adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "adagrad", "lion",
                        "muadam", "muadamw", "musgd", "muon")
DOCUMENTED_OPTIMIZERS = ("Adam", "AdamW", "OneBitAdam", "ZeroOneAdam", "Lamb", "OneBitLamb")

_ADAM = {"lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "torch_adam", "adam_w_mode",
         "adamw_mode", "set_grad_none", "fp32_optimizer_states"}
_COMM = {"freeze_step", "cuda_aware", "comm_backend_name"}
_LAMB = {"lr", "betas", "eps", "weight_decay", "bias_correction", "eps_inside_sqrt", "max_grad_norm", "max_coeff",
         "min_coeff", "amsgrad"}
KNOWN_PARAMS: dict[str, set[str]] = {
    "adam": _ADAM, "adamw": _ADAM, "lamb": _LAMB,
    "onebitadam": _ADAM | _COMM,
    "zerooneadam": _ADAM | _COMM | {"var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"},
    "onebitlamb": _LAMB | _COMM | {"coeff_beta", "factor_max", "factor_min", "factor_threshold"},
    "muon": {"lr", "momentum", "weight_decay", "muon_lr", "adam_lr", "ns_method", "betas", "eps"},
}
"""Parameters each DeepSpeed optimizer's constructor accepts (a near-miss of one of these gets a warning)."""

PARAM_DEFAULTS: dict[str, dict[str, Any]] = {
    "adam": {"torch_adam": False, "adam_w_mode": True},
    "adamw": {"torch_adam": False, "adam_w_mode": True},
    "onebitadam": {"freeze_step": 100000, "cuda_aware": False, "comm_backend_name": "nccl"},
    "zerooneadam": {"var_freeze_step": 100000, "var_update_scaler": 16, "local_step_scaler": 32678,
                    "local_step_clipper": 16, "cuda_aware": False, "comm_backend_name": "nccl"},
    "onebitlamb": {"max_coeff": 10.0, "min_coeff": 0.01, "freeze_step": 100000, "cuda_aware": False,
                   "comm_backend_name": "nccl", "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
                   "factor_threshold": 0.1},
}
"""Documented defaults of the DeepSpeed-specific parameters, per optimizer (lower-case type)."""


MUON_NS_METHODS = ("gram", "standard")
"""Muon's Newton-Schulz variants (``optimizer.params.ns_method``; default "gram")."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class OptimizerParams(DSConfigModel):
    """Constructor parameters. Documented ones are typed; unknown ones pass through to the constructor."""

    model_config = ConfigDict(extra="allow")

    lr: AutoNonNegF | None = None
    """Learning rate."""
    betas: Annotated[tuple[Float, Float] | Auto, KeepAuto()] | None = None
    """Adam/Lamb running-average coefficients (beta1, beta2)."""
    eps: AutoNonNegF | None = None
    weight_decay: AutoNonNegF | None = None
    bias_correction: AutoB | None = None
    amsgrad: AutoB | None = None
    torch_adam: AutoB | None = None
    """Adam/AdamW: use torch's implementation instead of DeepSpeed's fused one (default false)."""
    adam_w_mode: AutoB | None = None
    """Adam/AdamW: decoupled weight decay (AdamW) (default true)."""
    freeze_step: AutoI | None = None
    """1-bit optimizers: warm-up steps before 1-bit compression starts (default 100000)."""
    cuda_aware: AutoB | None = None
    """1-bit optimizers: the MPI library is CUDA-aware (default false)."""
    comm_backend_name: Annotated[str, KeepAuto()] | None = None
    """1-bit optimizers: communication backend (default "nccl")."""
    var_freeze_step: AutoI | None = None
    var_update_scaler: AutoI | None = None
    local_step_scaler: AutoI | None = None
    """0/1 Adam: interval to scale the local-step interval by the learning-rate policy (default 32678)."""
    local_step_clipper: AutoI | None = None
    """0/1 Adam: largest local-step interval (default 16)."""
    max_coeff: AutoF | None = None
    """LAMB: upper bound of the scaling coefficient (default 10.0)."""
    min_coeff: AutoF | None = None
    """LAMB: lower bound of the scaling coefficient (default 0.01)."""
    coeff_beta: AutoF | None = None
    factor_max: AutoF | None = None
    factor_min: AutoF | None = None
    factor_threshold: AutoF | None = None

    @model_validator(mode="after")
    def _check_bounds(self) -> OptimizerParams:
        pairs = (("min_coeff", "max_coeff"), ("factor_min", "factor_max"))
        for low, high in pairs:
            lo, hi = getattr(self, low), getattr(self, high)
            if isinstance(lo, float) and isinstance(hi, float) and lo > hi:
                raise ValueError(f"{low} ({lo}) must not exceed {high} ({hi})")
        if isinstance(self.betas, tuple) and not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {list(self.betas)}")
        return self

    def given(self) -> dict[str, Any]:
        """The parameters as written (documented and pass-through ones), without the unset ones."""
        out = {k: getattr(self, k) for k in self.model_fields_set}
        out.update(self.model_extra or {})
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


class OptimizerConfig(DSConfigModel):
    """``optimizer``: DeepSpeed builds this optimizer when the client passes none to ``initialize``."""

    type: str = Field(min_length=1)
    """Optimizer name: a DeepSpeed optimizer (Adam, AdamW, OneBitAdam, ZeroOneAdam, Lamb, OneBitLamb, ...;
    case-insensitive) or the name of a ``torch.optim`` optimizer."""
    params: OptimizerParams = Field(default_factory=OptimizerParams)
    """Constructor parameters (see ``OptimizerParams``)."""
    legacy_fusion: Bool = False
    """Use the legacy fused fp16 optimizer wrapper."""

    @field_validator("params", mode="before")
    @classmethod
    def _none_params(cls, value: Any) -> Any:
        return {} if value is None else value

    @model_validator(mode="after")
    def _warn_near_misses(self) -> OptimizerConfig:
        known = KNOWN_PARAMS.get(self.name)
        for key in (self.params.model_extra or {}) if known else ():
            hint = did_you_mean(key, known) if key not in known else ""
            if hint:
                warnings.warn(f"optimizer.params.{key}: not a parameter of {self.type}{hint}",
                              UnknownConfigKeyWarning, stacklevel=2)
        return self

    @model_validator(mode="after")
    def _check_muon(self) -> OptimizerConfig:
        """Muon's own parameters (DeepSpeed reads these five; ``lr``/``betas``/``eps``/``weight_decay`` as usual)."""
        if self.name != "muon":
            return self
        given = self.params.given()
        problems = []
        method = given.get("ns_method")
        if method is not None and method != "auto" and method not in MUON_NS_METHODS:
            problems.append(f"optimizer.params.ns_method={method!r}: accepted Newton-Schulz methods are "
                            f"{', '.join(repr(m) for m in MUON_NS_METHODS)}")
        momentum = given.get("momentum")
        if _is_number(momentum) and not 0 <= momentum < 1:
            problems.append(f"optimizer.params.momentum={momentum}: accepted is a number in [0, 1)")
        for key in ("muon_lr", "adam_lr"):
            value = given.get(key)
            if value is not None and value != "auto" and not (_is_number(value) and value >= 0):
                problems.append(f"optimizer.params.{key}={value!r}: accepted is a number >= 0")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def name(self) -> str:
        """Lower-case name for DeepSpeed's own optimizers, the name as written otherwise (torch.optim)."""
        return self.type.lower() if self.type.lower() in DEEPSPEED_OPTIMIZERS else self.type

    @property
    def is_deepspeed_optimizer(self) -> bool:
        return self.type.lower() in DEEPSPEED_OPTIMIZERS

    def constructor_params(self) -> dict[str, Any]:
        """Params as written, completed with the documented defaults of the DeepSpeed-specific keys."""
        return {**PARAM_DEFAULTS.get(self.name, {}), **self.params.given()}


"""The Muon optimizer from the config: which parameters Muon steps, and the parameter groups it gets.

``"optimizer": {"type": "Muon"}`` builds ds-ops' ``MuonWithAuxAdam`` with (at most) two groups per incoming
group: the parameters flagged ``param.use_muon = True`` (Muon: ``lr`` or ``muon_lr``, ``momentum``,
``weight_decay``, ``ns_method``) and the others (Adam: ``lr`` or ``adam_lr``, ``betas``, ``eps``,
``weight_decay``), trainable ones only, an empty group left out. A parameter without the flag gets DeepSpeed's
rule at ``initialize`` (:func:`mark_muon_params`): Muon for matrices (2 or more dimensions) unless its name
contains ``embed`` or ``lm_head``. A flag the model set itself is kept (DeepSpeed overwrites it).
Incoming groups (MoE expert groups, with ``moe`` and ``name``) keep their keys, so ZeRO still partitions each
over its expert-data-parallel group.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_ops.muon import MuonWithAuxAdam

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_NOT_MUON_NAMES = ("embed", "lm_head")


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's whole shape (a ZeRO-3 parameter's own tensor may be an empty placeholder)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def default_use_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule: hidden weight matrices use Muon, embeddings, output heads and vectors use Adam."""
    return len(_shape(param)) >= 2 and not any(key in name.lower() for key in _NOT_MUON_NAMES)


def mark_muon_params(module: torch.nn.Module, section: Any) -> None:
    """Give every parameter of ``module`` without a ``use_muon`` flag DeepSpeed's default, when the config's
    optimizer (``section``: the typed ``optimizer`` section, or None) is Muon."""
    if section is None or section.name != "muon":
        return
    for name, p in module.named_parameters():
        if not hasattr(p, "use_muon"):
            p.use_muon = default_use_muon(name, p)


def _hyper(kwargs: dict[str, Any], keys: tuple[str, ...], override: str) -> dict[str, Any]:
    out = {k: kwargs[k] for k in keys if k in kwargs}
    if override in kwargs:
        out["lr"] = kwargs[override]
    if "betas" in out:
        out["betas"] = tuple(out["betas"])
    return out


def muon_param_groups(params: Any, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``MuonWithAuxAdam`` groups for ``params`` (tensors, or groups as dicts) and the config's ``kwargs``."""
    items = list(params)
    incoming = [item for item in items if isinstance(item, dict)]
    loose = [item for item in items if not isinstance(item, dict)]
    if loose:
        incoming.append({"params": loose})
    muon_hp, adam_hp = _hyper(kwargs, MUON_KEYS, "muon_lr"), _hyper(kwargs, ADAM_KEYS, "adam_lr")
    groups = []
    for group in incoming:
        tensors = [p for p in group["params"] if p.requires_grad]
        unflagged = [_shape(p) for p in tensors if not hasattr(p, "use_muon")]
        if unflagged:
            raise ValueError(f"optimizer Muon: parameters of shapes {unflagged[:5]} have no use_muon flag (they are "
                             "not parameters of the model given to deepspeed.initialize); set param.use_muon = "
                             "True (Muon) or False (Adam) on every parameter")
        vectors = [_shape(p) for p in tensors if p.use_muon and len(_shape(p)) < 2]
        if vectors:
            raise ValueError(f"optimizer Muon: parameters of shapes {vectors[:5]} have use_muon = True, but Muon "
                             "orthogonalises matrices (2 or more dimensions); set use_muon = False on them (Adam)")
        extra = {k: v for k, v in group.items() if k != "params"}
        for use_muon, hp, default_name in ((True, muon_hp, "muon-params"), (False, adam_hp, "adam-params")):
            chosen = [p for p in tensors if bool(p.use_muon) == use_muon]
            if chosen:
                groups.append({"name": default_name, **hp, **extra, "params": chosen, "use_muon": use_muon})
    if not groups:
        raise ValueError("optimizer Muon: no trainable parameters to optimise")
    return groups


def muon_optimizer(params: Any, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    return MuonWithAuxAdam(muon_param_groups(params, kwargs))

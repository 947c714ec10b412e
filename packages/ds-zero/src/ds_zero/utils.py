"""``deepspeed.runtime.zero.utils``: small predicates about ZeRO-managed parameters."""

from __future__ import annotations

from typing import Any


def is_zero_param(parameter: Any) -> bool:
    """True for a ZeRO stage 3 partitioned parameter (it carries a ``ds_id``); stage 1/2 parameters keep their
    full shape on every rank, so they are not "ZeRO parameters" in this sense."""
    return hasattr(parameter, "ds_id")


class ZeRORuntimeException(Exception):
    """A ZeRO optimizer used in a way it cannot serve (DeepSpeed's name; raised e.g. when a client asks a ZeRO-3
    parameter's gradient while it is partitioned away)."""

"""``deepspeed.constants``: the torch.distributed defaults (rendezvous port, process-group timeout) and the
inference mode names, as DeepSpeed defines them. ``deepspeed.comm`` uses these values."""

from __future__ import annotations

import os
from datetime import timedelta

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def _timeout_from_env() -> timedelta:
    """``DEEPSPEED_TIMEOUT`` (minutes, default 30): how long a collective waits for its peers."""
    raw = os.getenv("DEEPSPEED_TIMEOUT", "30")
    try:
        return timedelta(minutes=float(raw))
    except ValueError:
        raise ValueError(f"DEEPSPEED_TIMEOUT={raw!r} must be a number of minutes") from None


default_pg_timeout = _timeout_from_env()
"""Process-group timeout for gloo and NCCL collectives (``DEEPSPEED_TIMEOUT`` minutes, read at import)."""

INFERENCE_GENERIC_MODE = "generic"
INFERENCE_SPECIALIZED_MODE = "specialized"

"""Communication: the ``comms_logger`` section (the top-level gradient-communication keys live on the
top-level config because DeepSpeed documents them there)."""

from __future__ import annotations

from ds_config._base import DSConfigModel
from ds_config._types import Bool


class CommsLoggerConfig(DSConfigModel):
    """``comms_logger``: record the collectives launched through ``deepspeed.comm``."""

    enabled: Bool = False
    """Enable communication logging (every logged call is synchronised for accurate timing)."""
    verbose: Bool = False
    """Print every communication operation as it happens."""
    prof_all: Bool = True
    """Profile every communication operation (otherwise only ``prof_ops``)."""
    debug: Bool = False
    """Append the caller's function name to each logged operation."""
    prof_ops: list[str] = []
    """Operations to profile when ``prof_all`` is false (e.g. ``["all_reduce", "all_gather"]``)."""

"""``deepspeed.utils``: the ``DeepSpeed`` logger and small helpers.

Submodules: ``logging`` (logger, ``log_dist``), ``comms_logging`` (the ``comms_logger`` records).
"""

from deepspeed.utils.logging import log_dist, logger

__all__ = ["log_dist", "logger"]

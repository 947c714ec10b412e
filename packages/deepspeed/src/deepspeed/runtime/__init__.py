"""DeepSpeed's runtime: the training engine's pieces (learning-rate schedules, ...).

Documented paths served by component packages (``deepspeed.runtime.config``, ``deepspeed.runtime.zero.config``)
come from the import hooks in ``deepspeed.compat``; modules here are the meta-package's own.
"""

from deepspeed.compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes, as in DeepSpeed

"""``deepspeed.checkpointing``: the activation checkpointing API.

DeepSpeed binds this name to ``deepspeed.runtime.activation_checkpointing.checkpointing``; importing it here gives
that very module object (one set of module-global settings, whichever path configured it).
"""

import sys

from deepspeed.runtime.activation_checkpointing import checkpointing as _checkpointing

sys.modules[__name__] = _checkpointing

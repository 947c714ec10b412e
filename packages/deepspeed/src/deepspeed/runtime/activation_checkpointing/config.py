"""``activation_checkpointing`` config: DeepSpeed's key names and defaults, and one resolver that reads the section
from whatever ``deepspeed.checkpointing.configure(deepspeed_config=...)`` is given."""

from __future__ import annotations

from typing import Any

from ds_config import ActivationCheckpointingConfig, load_config

ACT_CHKPT = "activation_checkpointing"
ACT_CHKPT_PARTITION_ACTIVATIONS = "partition_activations"
ACT_CHKPT_PARTITION_ACTIVATIONS_DEFAULT = False
ACT_CHKPT_NUMBER_CHECKPOINTS = "number_checkpoints"
ACT_CHKPT_NUMBER_CHECKPOINTS_DEFAULT = None
ACT_CHKPT_CONTIGUOUS_MEMORY_OPTIMIZATION = "contiguous_memory_optimization"
ACT_CHKPT_CONTIGUOUS_MEMORY_OPTIMIZATION_DEFAULT = False
ACT_CHKPT_SYNCHRONIZE_CHECKPOINT_BOUNDARY = "synchronize_checkpoint_boundary"
ACT_CHKPT_SYNCHRONIZE_CHECKPOINT_BOUNDARY_DEFAULT = False
ACT_CHKPT_PROFILE = "profile"
ACT_CHKPT_PROFILE_DEFAULT = False
ACT_CHKPT_CPU_CHECKPOINTING = "cpu_checkpointing"
ACT_CHKPT_CPU_CHECKPOINTING_DEFAULT = False

__all__ = ["ActivationCheckpointingConfig", "activation_checkpointing_section"]


def activation_checkpointing_section(deepspeed_config: Any, mpu: Any = None) -> ActivationCheckpointingConfig:
    """The typed ``activation_checkpointing`` section of ``deepspeed_config``.

    Accepts the section itself, a typed ``ds_config.DeepSpeedConfig``, DeepSpeed's ``DeepSpeedConfig`` object, or
    what DeepSpeed's ``DeepSpeedConfig(config, mpu)`` accepts (a dict, a JSON path, JSON or base64 text), which is
    validated as a whole (an unknown key is a ``ConfigError``); ``mpu`` is accepted for DeepSpeed's signature (the
    batch sizes are not resolved, so the data-parallel size is not needed).
    """
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    section = getattr(deepspeed_config, "activation_checkpointing_config", None)  # DeepSpeed's config object
    if section is None and not isinstance(deepspeed_config, (str, dict)):
        section = getattr(deepspeed_config, ACT_CHKPT, None)  # typed ds_config.DeepSpeedConfig
    if section is None:
        # validated whole but not resolved against a world size: the section does not depend on it, and an
        # engine's resolved ``config`` dict re-read with mpu=None would meet the whole world, not its data-parallel
        # part (a pipeline or tensor-parallel run), and fail the batch arithmetic it has already passed
        section = load_config(deepspeed_config).activation_checkpointing
    return section

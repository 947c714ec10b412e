"""``activation_checkpointing`` config: DeepSpeed's key names and defaults, and one resolver that reads the section
from whatever ``deepspeed.checkpointing.configure(deepspeed_config=...)`` is given."""

from __future__ import annotations

from typing import Any

from ds_config import ActivationCheckpointingConfig

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
    validated as a whole (an unknown key is a ``ConfigError``).
    """
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    section = getattr(deepspeed_config, "activation_checkpointing_config", None)  # DeepSpeed's config object
    if section is None and not isinstance(deepspeed_config, (str, dict)):
        section = getattr(deepspeed_config, ACT_CHKPT, None)  # typed ds_config.DeepSpeedConfig
    if section is None:
        from deepspeed.runtime.config import DeepSpeedConfig

        section = DeepSpeedConfig(deepspeed_config, mpu=mpu).activation_checkpointing_config
    return section

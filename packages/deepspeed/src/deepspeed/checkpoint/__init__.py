"""``deepspeed.checkpoint``: checkpoint utilities, the format's key strings (``constants``), file names per rank,
and the readers of a checkpoint folder at another parallel layout (``DeepSpeedCheckpoint``, ``ZeROCheckpoint``)."""

from deepspeed.checkpoint.constants import *  # noqa: F403 - DeepSpeed's package re-exports every key string
from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from deepspeed.checkpoint.reshape_3d_utils import get_model_3d_descriptor, model_3d_desc
from deepspeed.checkpoint.reshape_meg_2d import reshape_meg_2d_parallel
from deepspeed.checkpoint.reshape_utils import merge_state
from deepspeed.checkpoint.universal_checkpoint import SubparamShape  # noqa: F401 - allowed in weights_only loads
from deepspeed.checkpoint.utils import (
    clone_tensors_for_torch_save,
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)
from deepspeed.checkpoint.zero_checkpoint import ZeROCheckpoint

__all__ = ["DeepSpeedCheckpoint", "ZeROCheckpoint", "clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank",
           "get_model_3d_descriptor", "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank", "merge_state",
           "model_3d_desc", "reshape_meg_2d_parallel"]

"""``deepspeed.checkpoint``: checkpoint utilities, the format's key strings (``constants``), file names per rank."""

from deepspeed.checkpoint.constants import *  # noqa: F403 - DeepSpeed's package re-exports every key string
from deepspeed.checkpoint.utils import (
    clone_tensors_for_torch_save,
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)

__all__ = ["clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank",
           "get_zero_ckpt_name_for_rank"]

"""``deepspeed.checkpoint``: checkpoint utilities (``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``)."""

from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]

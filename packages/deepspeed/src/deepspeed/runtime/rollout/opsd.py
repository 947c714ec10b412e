"""On-policy distillation (OPSD) pieces: response-token targets from a rollout, and the generalized JSD loss.

The student generates (``RolloutEngine.generate``); student and teacher score the same sequences; the loss
compares their next-token distributions on the response tokens only. ``ResponseTokenBatch`` gives the causal
alignment (the logits at position ``i`` predict token ``i + 1``) and the mask of response targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from deepspeed.runtime.rollout.base import RolloutBatch

__all__ = ["JSDLossOutput", "ResponseTokenBatch", "generalized_jsd_loss"]


@dataclass(frozen=True)
class ResponseTokenBatch:
    """Causal targets of a rollout: ``target_ids`` = ``input_ids[:, 1:]`` and ``response_mask`` [B, T-1], True
    where the target is a real response token (at or after ``response_start_idx`` and in the attention mask)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    response_mask: torch.Tensor

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch) -> ResponseTokenBatch:
        ids, mask, start = rollout.input_ids, rollout.attention_mask, rollout.response_start_idx
        for name, tensor in (("attention_mask", mask), ("response_start_idx", start)):
            if tensor.device != ids.device:
                raise ValueError(f"rollout {name} is on {tensor.device}, input_ids on {ids.device}: they must be "
                                 "on the same device")
        if start.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"rollout response_start_idx must be int32 or int64, got {start.dtype}")
        length = ids.shape[1]
        if bool(((start < 1) | (start > length)).any()):
            raise ValueError(f"rollout response_start_idx must be in [1, {length}] (the sequence length), got "
                             f"{start.tolist()}")
        target_pos = torch.arange(1, length, device=ids.device)
        response = (target_pos.unsqueeze(0) >= start.unsqueeze(1)) & mask[:, 1:].bool()
        return cls(input_ids=ids, attention_mask=mask, target_ids=ids[:, 1:], response_mask=response)

    def select_causal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [B, T, V] of ``input_ids`` -> [B, T-1, V], aligned with ``target_ids``."""
        if logits.dim() != 3:
            raise ValueError(f"logits must be 3-D [batch, sequence_length, vocabulary_size], got "
                             f"{tuple(logits.shape)}")
        if logits.shape[:2] != self.input_ids.shape:
            raise ValueError(f"logits batch and sequence dimensions {tuple(logits.shape[:2])} must match "
                             f"input_ids {tuple(self.input_ids.shape)}")
        return logits[:, :-1, :]


@dataclass(frozen=True)
class JSDLossOutput:
    """``loss`` = ``loss_sum`` / max(``valid_token_count``, 1); the sum and count let ranks average over all
    their tokens (all-reduce both, then divide) instead of averaging per-rank means."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    valid_token_count: torch.Tensor


def _check_jsd_args(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, beta: float,
                    temperature: float, teacher_top_k: Optional[int], pointwise_clip: Optional[float]) -> None:
    if student.dim() != 3 or student.shape != teacher.shape:
        raise ValueError(f"student_logits and teacher_logits must have matching 3-D shapes, got "
                         f"{tuple(student.shape)} and {tuple(teacher.shape)}")
    if mask.shape != student.shape[:2]:
        raise ValueError(f"response_mask shape {tuple(mask.shape)} must match the logits' batch and sequence "
                         f"dimensions {tuple(student.shape[:2])}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if teacher_top_k is not None and not 0 < teacher_top_k <= student.shape[-1]:
        raise ValueError(f"teacher_top_k must be in [1, {student.shape[-1]}] (the vocabulary size) when given, "
                         f"got {teacher_top_k!r}")
    if pointwise_clip is not None and pointwise_clip < 0.0:
        raise ValueError(f"pointwise_clip must be >= 0 when given, got {pointwise_clip!r}")


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, response_mask: torch.Tensor,
                         beta: float = 0.5, temperature: float = 1.0, teacher_top_k: Optional[int] = None,
                         pointwise_clip: Optional[float] = None) -> JSDLossOutput:
    """Mean over the masked tokens of the generalized Jensen-Shannon divergence between student S and teacher T.

    With M = (1 - beta) S + beta T: beta KL(T || M) + (1 - beta) KL(S || M); the end points are the KLs themselves:
    ``beta=0`` is KL(T || S) (forward), ``beta=1`` KL(S || T) (reverse). Logits are divided by ``temperature``;
    ``teacher_top_k`` restricts both distributions to the teacher's k most likely entries (renormalised);
    ``pointwise_clip`` caps each vocabulary entry's contribution before the per-token sum.
    """
    _check_jsd_args(student_logits, teacher_logits, response_mask, beta, temperature, teacher_top_k, pointwise_clip)
    student, teacher = student_logits / temperature, teacher_logits / temperature
    if teacher_top_k is not None:
        keep = teacher.topk(teacher_top_k, dim=-1).indices
        student, teacher = student.gather(-1, keep), teacher.gather(-1, keep)
    log_s, log_t = F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)
    if beta == 0.0:
        pointwise = log_t.exp() * (log_t - log_s)
    elif beta == 1.0:
        pointwise = log_s.exp() * (log_s - log_t)
    else:
        log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
        pointwise = beta * log_t.exp() * (log_t - log_m) + (1.0 - beta) * log_s.exp() * (log_s - log_m)
    if pointwise_clip is not None:
        pointwise = pointwise.clamp(max=pointwise_clip)
    weights = response_mask.to(pointwise.dtype)
    loss_sum = (pointwise.sum(-1) * weights).sum()
    count = weights.sum().to(torch.long)
    return JSDLossOutput(loss=loss_sum / count.clamp_min(1), loss_sum=loss_sum, valid_token_count=count)

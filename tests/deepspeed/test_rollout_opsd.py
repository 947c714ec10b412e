"""deepspeed.runtime.rollout.opsd: response-token targets of a rollout and the generalized JSD loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepspeed.runtime.rollout import RolloutBatch, generalized_jsd_loss
from deepspeed.runtime.rollout.opsd import ResponseTokenBatch


def _rollout() -> RolloutBatch:
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [4, 5, 6, 9, 2, 3]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    return RolloutBatch(ids, mask, torch.tensor([3, 3]))


def test_response_targets_are_the_shifted_response_tokens() -> None:
    batch = ResponseTokenBatch.from_rollout(_rollout())
    assert torch.equal(batch.target_ids, _rollout().input_ids[:, 1:])
    # targets at positions 3.. (the response), minus the padding of row 0
    assert batch.response_mask.tolist() == [[False, False, True, True, False], [False, False, True, True, True]]
    logits = torch.randn(2, 6, 11)
    assert torch.equal(batch.select_causal_logits(logits), logits[:, :5])
    with pytest.raises(ValueError, match=r"must match input_ids \(2, 6\)"):
        batch.select_causal_logits(torch.randn(2, 5, 11))
    with pytest.raises(ValueError, match=r"must be in \[1, 6\]"):
        ResponseTokenBatch.from_rollout(RolloutBatch(_rollout().input_ids, _rollout().attention_mask,
                                                     torch.tensor([0, 3])))


def _logits(seed: int, shape: tuple[int, ...] = (2, 5, 7)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def _masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (per_token * mask).sum() / mask.sum()


def test_end_points_are_the_two_kls_and_the_middle_is_js() -> None:
    s, t = _logits(0), _logits(1)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.float64)
    log_s, log_t = s.log_softmax(-1), t.log_softmax(-1)
    forward = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)  # KL(T || S)
    reverse = F.kl_div(log_t, log_s, log_target=True, reduction="none").sum(-1)  # KL(S || T)
    assert torch.allclose(generalized_jsd_loss(s, t, mask, beta=0.0).loss, _masked_mean(forward, mask))
    assert torch.allclose(generalized_jsd_loss(s, t, mask, beta=1.0).loss, _masked_mean(reverse, mask))
    m = (log_s.exp() + log_t.exp()) / 2
    js = 0.5 * (log_t.exp() * (log_t - m.log())).sum(-1) + 0.5 * (log_s.exp() * (log_s - m.log())).sum(-1)
    out = generalized_jsd_loss(s, t, mask)
    assert torch.allclose(out.loss, _masked_mean(js, mask))
    assert torch.allclose(out.loss, generalized_jsd_loss(t, s, mask).loss)  # symmetric at beta = 0.5
    assert 0 < out.loss < math.log(2)
    assert out.valid_token_count.item() == 7 and out.valid_token_count.dtype == torch.long
    assert generalized_jsd_loss(s, s, mask, beta=0.3).loss.abs() < 1e-12


def test_temperature_top_k_clip_and_aggregation() -> None:
    s, t = _logits(2), _logits(3)
    mask = torch.ones(2, 5)
    assert torch.allclose(generalized_jsd_loss(s, t, mask, temperature=2.0).loss,
                          generalized_jsd_loss(s / 2, t / 2, mask).loss)
    keep = t.topk(3, dim=-1).indices
    assert torch.allclose(generalized_jsd_loss(s, t, mask, teacher_top_k=3).loss,
                          generalized_jsd_loss(s.gather(-1, keep), t.gather(-1, keep), mask).loss)
    assert generalized_jsd_loss(s, t, mask, pointwise_clip=0.01).loss <= 7 * 0.01 + 1e-12
    # per-rank sums and counts add up to the whole batch's loss
    parts = [generalized_jsd_loss(s[i:i + 1], t[i:i + 1], mask[i:i + 1]) for i in range(2)]
    whole = generalized_jsd_loss(s, t, mask)
    assert torch.allclose(sum(p.loss_sum for p in parts) / sum(p.valid_token_count for p in parts), whole.loss)
    s_grad = s.clone().requires_grad_(True)
    generalized_jsd_loss(s_grad, t, mask).loss.backward()
    assert s_grad.grad.abs().sum() > 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"beta": 1.5}, r"beta must be in \[0, 1\], got 1.5"),
    ({"temperature": 0.0}, "temperature must be positive"),
    ({"teacher_top_k": 8}, r"teacher_top_k must be in \[1, 7\]"),
    ({"pointwise_clip": -1.0}, "pointwise_clip must be >= 0"),
])
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generalized_jsd_loss(_logits(0), _logits(1), torch.ones(2, 5), **kwargs)

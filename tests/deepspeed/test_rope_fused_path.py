"""``deepspeed.sequence.layer.apply_rotary_pos_emb`` takes torchembed's fused RoPE kernel (when installed) for
tensors on an accelerator whose dim 0 is the caches' sequence dim, and the reference formula otherwise; both give
the same values. ``_torchembed_available`` says whether torchembed is installed (DeepSpeed's flag); the kernel
imports at its first use."""

from __future__ import annotations

import importlib.util

import torch

from deepspeed.sequence import layer


def _caches(seq: int, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    freqs = torch.outer(torch.arange(seq).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _kernel_stand_in(calls: list):
    """torchembed's ``fused_rope_forward(q, k, cos, sin)`` contract: (…, seq, dim) inputs, [seq, dim] caches."""

    def fused(q, k, cos, sin):
        calls.append((tuple(q.shape), tuple(cos.shape)))
        rotate = lambda x: torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)  # noqa: E731
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    return fused


def test_flag_reports_whether_torchembed_imports():
    assert layer._torchembed_available == (importlib.util.find_spec("torchembed") is not None)


def test_fused_path_matches_the_reference(monkeypatch):
    torch.manual_seed(0)
    t = torch.randn(7, 4, 40)  # [seq, heads, dim]; rotary on the first 32 features
    cos, sin = _caches(7, 32)
    reference = layer.apply_rotary_pos_emb(t, cos.unsqueeze(1), sin.unsqueeze(1))
    calls: list = []
    monkeypatch.setattr(layer, "_torchembed_available", True)
    monkeypatch.setattr(layer, "_torchembed_rope_forward", _kernel_stand_in(calls))
    monkeypatch.setattr(type(layer.get_accelerator()), "on_accelerator", lambda self, x: True)
    fused = layer.apply_rotary_pos_emb(t, cos.unsqueeze(1), sin.unsqueeze(1))
    assert calls == [((4, 7, 32), (7, 32))]  # sequence moved next to last, caches flattened to [seq, rot]
    torch.testing.assert_close(fused, reference)
    assert torch.equal(fused[..., 32:], t[..., 32:])  # the features past rot_dim pass through
    # caches that do not line up with t's dim 0 (another layout): the reference formula, no kernel call
    batch_first = t.transpose(0, 1)
    out = layer.apply_rotary_pos_emb(batch_first, cos, sin)
    assert len(calls) == 1
    torch.testing.assert_close(out, reference.transpose(0, 1))

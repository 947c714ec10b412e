"""AutoSP for multimodal models (deepspeed.sequence.auto_sp, autosp_vit, autosp_fusion) on 2 gloo ranks: each rank's
output equals its slice of the one-process computation, and gradients (summed over the ranks, as the sequence-data
reduction does) equal the one-process gradients, with uneven patch shards and CLS tokens."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

HIDDEN, HEADS = 8, 2


class _SelfAttention(torch.nn.Module):
    """A real bidirectional attention layer with the Hugging Face ViT call shape (hidden_states in, tuple out)."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)

    def forward(self, hidden_states, **kwargs):
        out, weights = self.mha(hidden_states, hidden_states, hidden_states)
        return out, weights


def _shares(total: int, world: int) -> list[int]:
    return [total // world + (r < total % world) for r in range(world)]


def _vit(has_cls: bool, patches: int) -> None:
    from deepspeed.sequence.autosp_vit import UlyssesSPViTAttention

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    attn = _SelfAttention()
    full = torch.randn(2, patches + has_cls, HIDDEN)
    weight = torch.randn_like(full)  # the loss's weights: every output row matters differently
    ref_in = full.clone().requires_grad_()
    ref_out, _ = attn(ref_in)
    (ref_out * weight).sum().backward()
    ref_grads = [p.grad.clone() for p in attn.parameters()]
    attn.zero_grad()

    shares, skip = _shares(patches, world), int(has_cls)
    start = skip + sum(shares[:rank])
    rows = list(range(skip)) + list(range(start, start + shares[rank]))
    local_in = full[:, rows].clone().requires_grad_()
    wrapper = UlyssesSPViTAttention(attn, dist.group.WORLD, has_cls_token=has_cls)
    out, attn_weights = wrapper(local_in)
    assert attn_weights.shape[-1] == patches + skip  # extra outputs pass through, over the whole sequence
    torch.testing.assert_close(out, ref_out[:, rows].detach())
    local_weight = weight[:, rows].clone()
    if has_cls and rank:  # the CLS row is replicated: rank 0's copy stands for it in the loss
        local_weight[:, 0] = 0
    (out * local_weight).sum().backward()
    torch.testing.assert_close(local_in.grad[:, skip:], ref_in.grad[:, rows][:, skip:])
    if has_cls:  # each replica's gradient is a part of the CLS token's
        cls_grad = local_in.grad[:, :1].clone()
        dist.all_reduce(cls_grad)
        torch.testing.assert_close(cls_grad, ref_in.grad[:, :1])
    for p, ref in zip(attn.parameters(), ref_grads, strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize("has_cls,patches", [(False, 5), (True, 5), (True, 8)])
def test_vit_attention_equals_one_process_with_uneven_shards(has_cls, patches):
    run_distributed(_vit, world_size=2, args=(has_cls, patches), timeout=60)


IMG, START, END = -200, 7, 9


def _fusion_case(kind: str):
    from deepspeed.sequence.autosp_fusion import InternVLFusionAdapter, LlavaFusionAdapter, Qwen2VLFusionAdapter

    torch.manual_seed(1)
    projection = torch.nn.Linear(4, HIDDEN)
    visual = torch.randn(2, 6, 4)
    text = torch.randn(2, 11, HIDDEN)
    ids = torch.zeros(2, 11, dtype=torch.long)
    group = dist.group.WORLD
    if kind == "llava":  # sample 0: two images of 3 tokens each; sample 1: none
        ids[0, 2] = ids[0, 7] = IMG
        return LlavaFusionAdapter(projection, group, image_token_id=IMG), visual, text, ids
    if kind == "internvl":
        ids[:, 3:9] = IMG
        return InternVLFusionAdapter(projection, group, image_token_id=IMG), visual, text, ids
    ids[:, 1], ids[:, 4], ids[:, 5], ids[:, 10] = START, END, START, END  # 2 + 4 inner tokens
    return Qwen2VLFusionAdapter(projection, group, START, END), visual, text, ids


def _fusion(kind: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    adapter, visual, text, ids = _fusion_case(kind)
    ref_visual = visual.clone().requires_grad_()
    fused = adapter._splice_visual_into_text(text, adapter.projection(ref_visual), ids)
    if kind == "llava":
        assert fused.shape[1] == 11 - 2 + 6  # two placeholders out, six visual tokens in; sample 1 zero-padded
        torch.testing.assert_close(fused[1, 11:], torch.zeros(4, HIDDEN))
    else:
        assert fused.shape[1] == 11  # one-to-one replacement
        torch.testing.assert_close(fused[:, 0], text[:, 0])  # text tokens stay
    pad = -fused.shape[1] % world
    padded = torch.nn.functional.pad(fused, (0, 0, 0, pad))
    weight = torch.randn_like(padded)
    (padded * weight).sum().backward()
    ref_grad = adapter.projection.weight.grad.clone()
    adapter.zero_grad()

    share = visual.shape[1] // world
    local_visual = visual[:, rank * share:(rank + 1) * share].clone().requires_grad_()
    out = adapter(local_visual, text, ids)
    rows = slice(rank * out.shape[1], (rank + 1) * out.shape[1])
    torch.testing.assert_close(out, padded[:, rows].detach())
    (out * weight[:, rows]).sum().backward()
    torch.testing.assert_close(local_visual.grad, ref_visual.grad[:, rank * share:(rank + 1) * share])
    grad = adapter.projection.weight.grad.clone()
    dist.all_reduce(grad)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("kind", ["llava", "internvl", "qwen2vl"])
def test_fusion_adapters_shard_the_fused_sequence_and_sum_gradients_back(kind):
    run_distributed(_fusion, world_size=2, args=(kind,), timeout=60)


class SiglipAttention(_SelfAttention):  # registry names: no CLS token
    pass


class CLIPAttention(_SelfAttention):  # CLS token
    pass


class LlamaAttention(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        return hidden_states


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        self.vision[0].attn, self.vision[1].attn = SiglipAttention(), CLIPAttention()
        self.mm_projector = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN))
        self.decoder = torch.nn.Module()
        self.decoder.self_attn = LlamaAttention()


def _auto_wrap() -> None:
    from deepspeed.sequence.auto_sp import auto_wrap_model_for_sp
    from deepspeed.sequence.autosp_detector import detect_model_sp_info
    from deepspeed.sequence.autosp_vit import UlyssesSPViTAttention

    model = _Model()
    info = detect_model_sp_info(model)
    assert [n for n, _ in info.vit_attn_modules] == ["vision.0.attn", "vision.1.attn"]
    assert [n for n, _ in info.llm_attn_modules] == ["decoder.self_attn"]
    assert info.vision_projection_module[0] == "mm_projector"  # the outermost match, not mm_projector.0
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("deepspeed.sequence.auto_sp").addHandler(handler)
    assert auto_wrap_model_for_sp(model, dist.group.WORLD) is model
    wrapped = [model.vision[0].attn, model.vision[1].attn]
    assert all(isinstance(w, UlyssesSPViTAttention) for w in wrapped)
    assert [w.has_cls_token for w in wrapped] == [False, True]
    assert isinstance(model.decoder.self_attn, LlamaAttention)  # reported, not wrapped
    warned = " ".join(r.getMessage() for r in records if r.levelno == logging.WARNING)
    assert "decoder.self_attn" in warned and "mm_projector" in warned
    with pytest.raises(ValueError, match="_VIT_ATTN_CLASSNAMES"):
        auto_wrap_model_for_sp(torch.nn.Linear(2, 2), dist.group.WORLD)


def test_auto_wrap_wraps_vision_attention_reports_the_rest():
    run_distributed(_auto_wrap, world_size=2, timeout=60)


def _bad_inputs() -> None:
    from deepspeed.sequence.autosp_fusion import ModalityFusionSPAdapter, Qwen2VLFusionAdapter
    from deepspeed.sequence.autosp_vit import UlyssesSPViTAttention

    text, visual = torch.zeros(1, 6, HIDDEN), torch.zeros(1, 2, HIDDEN)
    ids = torch.zeros(1, 6, dtype=torch.long)
    ids[0, 4], ids[0, 2] = START, END  # end before start
    qwen = Qwen2VLFusionAdapter(torch.nn.Identity(), dist.group.WORLD, START, END)
    with pytest.raises(ValueError, match="each start needs its end"):
        qwen(visual, text, ids)
    with pytest.raises(ValueError, match="input_ids"):
        qwen(visual, text, ids[:, :3])
    with pytest.raises(NotImplementedError, match="LlavaFusionAdapter"):
        ModalityFusionSPAdapter(torch.nn.Identity(), dist.group.WORLD)(visual, text, ids)
    from deepspeed.sequence.autosp_fusion import LlavaFusionAdapter

    llava = LlavaFusionAdapter(torch.nn.Identity(), dist.group.WORLD, image_token_id=IMG)
    three = torch.zeros(1, 6, dtype=torch.long)
    three[0, [1, 3, 5]] = IMG  # 3 placeholders, 2 visual tokens: the third would keep its placeholder embedding
    with pytest.raises(ValueError, match="3 image placeholders .* 2 visual tokens"):
        llava._splice_visual_into_text(text, visual, three)
    with pytest.raises(ValueError, match="hidden_states must be"):
        UlyssesSPViTAttention(torch.nn.Identity(), dist.group.WORLD)(torch.zeros(2, 3))


def test_misuse_is_a_clear_error():
    run_distributed(_bad_inputs, world_size=2, timeout=60)

"""AutoSP at the vision-language boundary: adapters that turn sharded visual tokens and the whole text into this
rank's shard of the fused sequence the language decoder trains on.

Every adapter wraps the model's vision projection and, per forward:
1. projects this rank's visual tokens (``[batch, local_visual, vit_hidden]`` -> ``lm_hidden``);
2. gathers the visual tokens of every rank (rank order = token order; uneven shards allowed);
3. splices them into the text embeddings (``[batch, text_len, lm_hidden]``, whole on every rank) where the token
   ids hold image placeholders: the architecture-specific step, ``_splice_visual_into_text``;
4. zero-pads the fused sequence at the end to a multiple of the group size and returns this rank's contiguous
   equal share (rank r: rows ``[r * L/P, (r+1) * L/P)``).

Splicing rules: LLaVA replaces each placeholder token with its share of the visual tokens (the sequence grows);
InternVL replaces each ``IMG_CONTEXT`` token one-to-one; Qwen2-VL replaces one-to-one the tokens strictly between
each ``vision_start`` / ``vision_end`` pair. Gradients reach every rank's visual tokens: the gather's backward sums
over the group what each rank's shard used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import deepspeed.comm as dist
from deepspeed.sequence.autosp_gather import gather_sequence

_DEFAULT_IMAGE_TOKEN_ID = -200
"""LLaVA's image placeholder id."""


def shard_fused(fused: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's share of ``fused`` ([batch, length, hidden]) after zero-padding the length to a multiple of the
    group size."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pad = -fused.shape[1] % world
    if pad:
        fused = F.pad(fused, (0, 0, 0, pad))
    share = fused.shape[1] // world
    return fused[:, rank * share:(rank + 1) * share].contiguous()


def _check_inputs(name: str, visual: torch.Tensor, text: torch.Tensor, input_ids: torch.Tensor) -> None:
    if text.dim() != 3:
        raise ValueError(f"{name}: text_embeds must be [batch, text_len, hidden], got shape {tuple(text.shape)}")
    if tuple(input_ids.shape) != tuple(text.shape[:2]):
        raise ValueError(f"{name}: input_ids {tuple(input_ids.shape)} must be [batch, text_len] of text_embeds "
                         f"{tuple(text.shape)}")
    if visual.dim() != 3 or visual.shape[0] != text.shape[0] or visual.shape[2] != text.shape[2]:
        raise ValueError(f"{name}: projected visual tokens {tuple(visual.shape)} must be [batch, tokens, hidden] "
                         f"with the batch and hidden size of text_embeds {tuple(text.shape)}")


class ModalityFusionSPAdapter(torch.nn.Module):
    """Base adapter: wraps ``projection`` and runs steps 1-4 of the module docstring over ``process_group``.
    Subclasses give the splice (``_splice_visual_into_text(text_embeds, visual_embeds, input_ids)``, all whole
    sequences); ``image_token_id`` is the placeholder id they look for (LLaVA's -200 by default)."""

    def __init__(self, projection: torch.nn.Module, process_group: Any,
                 image_token_id: int = _DEFAULT_IMAGE_TOKEN_ID) -> None:
        super().__init__()
        self.projection = projection
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.image_token_id = image_token_id

    def forward(self, visual_features: torch.Tensor, text_embeds: torch.Tensor,
                input_ids: torch.Tensor) -> torch.Tensor:
        visual = self.projection(visual_features)
        _check_inputs(type(self).__name__, visual, text_embeds, input_ids)
        full_visual, _ = gather_sequence(visual, self.process_group, dim=1)
        fused = self._splice_visual_into_text(text_embeds, full_visual, input_ids)
        return shard_fused(fused, self.process_group)

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        # the one architecture-specific step: this base class has no rule of its own
        raise NotImplementedError(f"{type(self).__name__} has no splicing rule: use LlavaFusionAdapter, "
                                  "InternVLFusionAdapter or Qwen2VLFusionAdapter, or subclass ModalityFusionSPAdapter "
                                  "and define _splice_visual_into_text for the model")


class LlavaFusionAdapter(ModalityFusionSPAdapter):
    """LLaVA: every ``image_token_id`` placeholder of a sample is replaced by the next equal share of the sample's
    visual tokens (one share per placeholder, so the sequence grows); samples without a placeholder keep their
    text. Samples of different fused length are zero-padded at the end to the longest."""

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        samples = []
        for text, visual, ids in zip(text_embeds, visual_embeds, input_ids, strict=True):
            places = (ids == self.image_token_id).nonzero().flatten().tolist()
            if not places:
                samples.append(text)
                continue
            if visual.shape[0] < len(places) or visual.shape[0] % len(places):
                raise ValueError(f"LLaVA fusion: a sample has {len(places)} image placeholders (image_token_id "
                                 f"{self.image_token_id}) but {visual.shape[0]} visual tokens, which do not split "
                                 "into equal shares; accepted: a token count divisible by the placeholder count")
            shares = visual.split(visual.shape[0] // len(places), dim=0)
            pieces, after = [], 0
            for place, share in zip(places, shares, strict=True):
                pieces += [text[after:place], share]
                after = place + 1
            pieces.append(text[after:])
            samples.append(torch.cat(pieces, dim=0))
        longest = max(s.shape[0] for s in samples)
        return torch.stack([F.pad(s, (0, 0, 0, longest - s.shape[0])) for s in samples])


def _replace_rows(text_embeds: torch.Tensor, visual_embeds: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """``text_embeds`` with sample i's ``rows[i]`` (positions, in order) taken by its first visual tokens."""
    out = text_embeds.clone()
    for i, positions in enumerate(rows):
        if positions.numel() > visual_embeds.shape[1]:
            raise ValueError(f"sample {i} has {positions.numel()} visual placeholders but only "
                             f"{visual_embeds.shape[1]} visual tokens were gathered")
        if positions.numel():
            out[i, positions] = visual_embeds[i, :positions.numel()].to(out.dtype)
    return out


class InternVLFusionAdapter(ModalityFusionSPAdapter):
    """InternVL: each ``IMG_CONTEXT`` token (``image_token_id``) is replaced one-to-one, in order, by a visual
    token; the image start/end tokens and the length stay."""

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        rows = [(ids == self.image_token_id).nonzero().flatten() for ids in input_ids]
        return _replace_rows(text_embeds, visual_embeds, rows)


class Qwen2VLFusionAdapter(ModalityFusionSPAdapter):
    """Qwen2-VL: the tokens strictly between each ``vision_start_token_id`` / ``vision_end_token_id`` pair are
    replaced one-to-one, in order, by visual tokens; the boundary tokens and the length stay."""

    def __init__(self, projection: torch.nn.Module, process_group: Any, vision_start_token_id: int,
                 vision_end_token_id: int) -> None:
        super().__init__(projection, process_group, image_token_id=vision_start_token_id)
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        rows = []
        for i, ids in enumerate(input_ids):
            starts = (ids == self.vision_start_token_id).nonzero().flatten().tolist()
            ends = (ids == self.vision_end_token_id).nonzero().flatten().tolist()
            if len(starts) != len(ends) or any(s >= e for s, e in zip(starts, ends, strict=True)):
                raise ValueError(f"Qwen2VLFusionAdapter: sample {i} has vision_start tokens at {starts} and "
                                 f"vision_end tokens at {ends}; each start needs its end after it")
            inner = [p for s, e in zip(starts, ends, strict=True) for p in range(s + 1, e)]
            rows.append(torch.tensor(inner, dtype=torch.long, device=text_embeds.device))
        return _replace_rows(text_embeds, visual_embeds, rows)

"""AutoSP for vision encoders: ``UlyssesSPViTAttention`` runs a ViT attention layer on patch tokens sharded along
the sequence.

ViT attention is bidirectional (every patch attends to every patch), and the wrapped layer is opaque (any module
mapping ``hidden_states`` to ``hidden_states``), so its heads cannot be split the Ulysses way. Instead each rank
gathers the whole patch sequence, runs the layer on it exactly as one device would, and keeps the output rows of
its own patches. The layers around attention (MLP, norms) keep working on the shard, which is where the memory goes
down. A CLS token, when the model has one, sits at position 0 of every rank's shard (replicated, not sharded):
it joins the gathered sequence once, in front, and every rank keeps its output. Shards may have uneven lengths
(5 patches on 2 ranks: 3 and 2); the layer always sees exactly the real patches, no padding.
"""

from __future__ import annotations

from typing import Any

import torch

import deepspeed.comm as dist
from deepspeed.sequence.autosp_gather import gather_sequence


class UlyssesSPViTAttention(torch.nn.Module):
    """Sequence-parallel wrapper of a ViT attention module ``attn`` over ``process_group``.

    ``forward(hidden_states [batch, local_len, hidden], **kwargs)``: ``local_len`` is this rank's patch count, plus
    one when ``has_cls_token``. Keyword arguments go to ``attn`` unchanged. Returns what ``attn`` returns, with the
    output tensor (or a tuple's first element) cut back to this rank's rows."""

    def __init__(self, attn: torch.nn.Module, process_group: Any, has_cls_token: bool = True) -> None:
        super().__init__()
        if not isinstance(attn, torch.nn.Module):
            raise TypeError(f"UlyssesSPViTAttention: attn must be an nn.Module, got {type(attn).__name__}")
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.has_cls_token = bool(has_cls_token)

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}, has_cls_token={self.has_cls_token}"

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        if hidden_states.dim() != 3:
            raise ValueError("UlyssesSPViTAttention: hidden_states must be [batch, local_seq_len, hidden], got shape "
                             f"{tuple(hidden_states.shape)}")
        skip = 1 if self.has_cls_token else 0
        if hidden_states.shape[1] < skip:
            raise ValueError("UlyssesSPViTAttention: has_cls_token=True but hidden_states holds no token")
        patches = hidden_states[:, skip:]
        full, lengths = gather_sequence(patches, self.process_group, dim=1)
        if skip:
            full = torch.cat([hidden_states[:, :1], full], dim=1)
        result = self.attn(full, **kwargs)
        out, rest = (result[0], tuple(result[1:])) if isinstance(result, (tuple, list)) else (result, None)
        start = skip + sum(lengths[:dist.get_rank(self.process_group)])
        mine = out.narrow(1, start, patches.shape[1])
        if skip:
            mine = torch.cat([out[:, :1], mine], dim=1)
        mine = mine.contiguous()
        return mine if rest is None else (mine, *rest)

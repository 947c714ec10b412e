"""Plain-torch token sampling, gather and scatter for random-LTD (DeepSpeed's ``dropping_utils`` semantics).

Indices are ``[layers, batch, kept]``, sorted along the last dimension so kept tokens stay in sequence order.
Gather and scatter are ordinary differentiable torch ops: the gradient of a dropped token passes straight
through, a kept token's flows through the layer, as DeepSpeed's custom autograd functions give.
"""

from __future__ import annotations

import torch


def _sorted_random_indices(reserved_length: int, seq_length: int, batch_size: int, layers: int,
                           device: torch.device | str) -> torch.Tensor:
    """``[layers, batch, reserved_length]`` distinct token positions per sample, ascending (int64)."""
    weights = torch.ones((layers * batch_size, seq_length), device=device)
    indices = torch.multinomial(weights, reserved_length)
    return indices.sort(dim=-1).values.reshape(layers, batch_size, reserved_length)


def gpt_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1,
                      device: torch.device | str = "cpu", attn_mask: torch.Tensor | None = None):
    """Decoder: random sorted indices, and the causal mask cut to ``[..., :kept, :kept]`` (shared by layers)."""
    indices = _sorted_random_indices(reserved_length, seq_length, batch_size, layers, device)
    new_mask = attn_mask[:, :, :reserved_length, :reserved_length] if attn_mask is not None else None
    return indices, new_mask


def bert_sample_tokens(reserved_length: int, seq_length: int, batch_size: int, layers: int = 1,
                       device: torch.device | str = "cpu", attn_mask: torch.Tensor | None = None):
    """Encoder: random sorted indices, and per layer the ``[batch, 1|heads, kept, kept]`` mask of the kept
    tokens (rows and columns gathered per sample)."""
    if attn_mask is None:
        raise ValueError("random-LTD with model_type 'encoder' needs the attention mask (model_mask_name)")
    indices = _sorted_random_indices(reserved_length, seq_length, batch_size, layers, device)
    masks = []
    for layer in range(layers):
        per_sample = [attn_mask[i:i + 1][:, :, indices[layer, i]][:, :, :, indices[layer, i]]
                      for i in range(batch_size)]
        masks.append(torch.cat(per_sample, dim=0))
    return indices, masks


def _expand(indices: torch.Tensor, hidden: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """``[batch, kept]`` indices expanded to index the sequence dim of ``hidden`` along its hidden size."""
    idx = indices.long().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return idx if batch_first else idx.transpose(0, 1)


def gather_tokens(hidden: torch.Tensor, indices: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The kept tokens of ``hidden`` (``[B, S, H]`` or ``[S, B, H]``) -> ``[B, kept, H]`` or ``[kept, B, H]``."""
    dim = 1 if batch_first else 0
    return torch.gather(hidden, dim, _expand(indices, hidden, batch_first))


def scatter_tokens(hidden: torch.Tensor, part: torch.Tensor, indices: torch.Tensor,
                   batch_first: bool) -> torch.Tensor:
    """``hidden`` with the kept positions replaced by ``part`` (out of place)."""
    dim = 1 if batch_first else 0
    return hidden.scatter(dim, _expand(indices, hidden, batch_first), part.to(hidden.dtype))

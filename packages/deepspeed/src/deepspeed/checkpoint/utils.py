"""Checkpoint helpers (``deepspeed.checkpoint.utils``)."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """A copy of ``item`` whose tensors are detached clones on ``device``.

    Why: ``torch.save`` writes a tensor's whole storage, so a view into a flat ZeRO buffer (or any slice)
    drags the full buffer into the file. A clone owns a storage exactly its own size. Works on tensors and
    on lists, tuples (named tuples included) and dicts nesting them; dict subclasses keep their type and a
    ``state_dict``'s ``_metadata`` (used by ``load_state_dict``) is kept. Anything else is returned as is.
    """
    device = torch.device(device)
    if torch.is_tensor(item):
        # copy=True always allocates (even on the same device), sized to the elements, not the viewed
        # storage; dense views keep their strides, others come out contiguous
        return item.detach().to(device, copy=True)
    if isinstance(item, dict):
        cloned = type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
        if hasattr(item, "_metadata"):
            cloned._metadata = item._metadata
        return cloned
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return type(item)(*(clone_tensors_for_torch_save(v, device) for v in item))
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item

"""Backward attribution: which module's forward created each autograd node.

Backward ops run inside the autograd engine, outside any module call, so module hooks cannot say whose
they are. Each autograd node carries the sequence number of the forward op that created it; a module's
forward hook tags the nodes created during that call (sequence number >= the counter's value when the call
began), innermost module first (the recorder keeps the walk's time out of the callers' latencies). During
backward, ``torch._C._current_autograd_node()`` names the node whose
backward is running, and its tag names the module chain to book the cost to. Only integers and module
tuples are stored, never nodes, so no activation is kept alive.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

_get_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)
# AccumulateGrad and graph roots share the maximal sequence number; they belong to no module.
_UNOWNED = 2**63


_grad_enabled = torch.is_grad_enabled


def sequence_mark() -> int | None:
    """The autograd sequence counter now, or None when no graph is being recorded (or torch lacks it)."""
    if _get_sequence_nr is None or not _grad_enabled():
        return None
    return _get_sequence_nr()


def output_nodes(output: Any) -> list:
    """The autograd nodes that produced the tensors in a module's output."""
    return [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def tag_nodes(nodes: list, start: int, chain: tuple, owners: dict[int, tuple]) -> None:
    """Tag the nodes behind ``nodes`` created since ``start`` with ``chain``, keeping inner modules' tags."""
    pending = list(nodes)
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        seq = node._sequence_nr()
        if seq < start or seq >= _UNOWNED or seq in seen:
            continue
        seen.add(seq)
        owners.setdefault(seq, chain)
        pending.extend(child for child, _ in node.next_functions if child is not None)


class GradOwners:
    """Sequence number -> owning module chain (``()`` for an ignored module)."""

    def __init__(self) -> None:
        self.owners: dict[int, tuple] = {}

    def tag(self, output: Any, start: int, chain: tuple) -> None:
        """Tag the nodes a finished module call created."""
        nodes = output_nodes(output)
        if nodes:
            tag_nodes(nodes, start, chain, self.owners)

    def running_owner(self) -> tuple | None:
        """The module chain owning the autograd node now executing (None: unknown or outside backward)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        return self.owners.get(node._sequence_nr())

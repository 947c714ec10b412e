"""Which way a fused gate+up expert weight is laid out, read from the two expert tensors' shapes.

Transformers stores the fused experts as ``gate_up [E, 2*ffn, hidden]`` with ``down [E, hidden, ffn]``
("gate_up_first", the ``nn.Linear`` orientation) or as ``gate_up [E, hidden, 2*ffn]`` with ``down [E, ffn,
hidden]`` ("hidden_first", transposed: ``x @ w``). AutoEP's grouped experts keep the first orientation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FusedLayout = Literal["gate_up_first", "hidden_first"]


@dataclass(frozen=True)
class FusedExpertLayout:
    layout: FusedLayout
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool
    """True when the weights must be transposed into the ``[E, out, in]`` orientation."""


def classify_fused_gate_up_layout(w1_shape: tuple[int, ...], w2_shape: tuple[int, ...]) -> FusedExpertLayout | None:
    """The layout of fused ``w1`` (gate+up) and ``w2`` (down) expert weights of these shapes; None when the shapes
    pair up neither way (not 3-D, an odd fused dimension, or mismatched sizes)."""
    if len(w1_shape) != 3 or len(w2_shape) != 3:
        return None
    _, rows, cols = w1_shape
    if rows % 2 == 0 and tuple(w2_shape[1:]) == (cols, rows // 2):
        return FusedExpertLayout("gate_up_first", hidden_size=cols, ffn_hidden_size=rows // 2, needs_transpose=False)
    if cols % 2 == 0 and tuple(w2_shape[1:]) == (cols // 2, rows):
        return FusedExpertLayout("hidden_first", hidden_size=rows, ffn_hidden_size=cols // 2, needs_transpose=True)
    return None

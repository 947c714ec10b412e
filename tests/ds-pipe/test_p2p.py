"""The stage-link wire format without processes: layouts survive encoding, and what cannot travel is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ds_pipe.p2p import _DTYPES, Layout, TensorMeta

metas = st.builds(TensorMeta, st.sampled_from(_DTYPES), st.lists(st.integers(0, 9), max_size=5).map(tuple),
                  st.booleans())


@given(st.lists(metas, min_size=1, max_size=6), st.booleans())
def test_layout_round_trips(tensors, single):
    layout = Layout(tuple(tensors[:1] if single else tensors), single)
    assert Layout.decode(layout.encode()) == layout


def test_layout_of_values():
    x = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, dtype=torch.bool)
    assert Layout.of(x) == Layout((TensorMeta(torch.float32, (2, 3), True),), single=True)
    both = Layout.of((x, mask))
    assert not both.single and both.describe() == "[(2, 3) float32 (grad), (2,) bool]"


def test_what_cannot_travel_is_refused():
    with pytest.raises(TypeError, match="element 1 is a str"):
        Layout.of((torch.zeros(1), "labels"))
    with pytest.raises(TypeError, match="dtype torch.uint16"):
        Layout.of(torch.zeros(2, dtype=torch.uint16))

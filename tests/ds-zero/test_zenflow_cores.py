"""ZenFlow's split of a rank's cores between the CPU optimizer and the training thread (ds_zero.zenflow)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds_zero.zenflow import split_affinity


@given(st.lists(st.integers(0, 511), min_size=1, max_size=64, unique=True), st.floats(0.0, 1.0))
def test_split_partitions_the_cores_or_shares_them(cores, perc):
    optimizer, training = split_affinity(cores, perc)
    reserved = math.ceil(perc * len(cores))
    if 0 < reserved < len(cores):
        assert training == cores[:reserved] and optimizer == cores[reserved:]
    else:  # one side would be empty: both keep every core
        assert optimizer == training == cores


def test_training_side_rounds_up():
    assert split_affinity([4, 5, 6, 7, 8], 0.3) == ([6, 7, 8], [4, 5])


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_fraction_is_checked(bad):
    with pytest.raises(ValueError, match=rf"pt_reserved_cores_perc: must be a fraction in \[0, 1\] \(got {bad}\)"):
        split_affinity([0, 1], bad)

"""``ProcessTopology`` and its named subclasses without processes: every example of the spec's "Pipeline
Parallelism" chapter, the row-major layout against an independent reference, and bad input."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds_pipe import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from ds_pipe.topology import _prime_factors, default_topology

# --- the spec's examples, one by one ---


def test_spec_get_rank():
    X = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert X.get_rank(x=0, y=1) == 1


def test_spec_get_rank_repr():
    topo = ProcessTopology(axes=["a", "b"], dims=[2, 2])
    assert topo.get_rank_repr(rank=3) == "a_01-b_01"
    assert topo.get_rank_repr(rank=3, omit_axes=["a"]) == "b_01"


def test_spec_get_dim():
    X = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert X.get_dim("y") == 3


def test_spec_get_coord():
    X = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    coord = X.get_coord(rank=1)
    assert (coord.x, coord.y) == (0, 1)
    assert type(coord).__name__ == "ProcessCoord" and coord._fields == ("x", "y")


def test_spec_get_axis_comm_lists():
    topo = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert topo.get_axis_comm_lists("pipe") == [
        [0, 4],  # data=0, model=0
        [1, 5],  # data=0, model=1
        [2, 6],  # data=1, model=0
        [3, 7],  # data=1, model=1
    ]


def test_spec_filter_match():
    X = ProcessTopology(axes=["pipe", "data", "model"], dims=[2, 2, 2])
    assert X.filter_match(pipe=0, data=1) == [2, 3]
    coords = [X.get_coord(rank) for rank in X.filter_match(pipe=0, data=1)]
    assert [repr(c) for c in coords] == ["ProcessCoord(pipe=0, data=1, model=0)",
                                         "ProcessCoord(pipe=0, data=1, model=1)"]


def test_spec_get_axis_list():
    X = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert X.get_axis_list(axis="x", idx=0) == [0, 1, 2]
    assert X.get_axis_list(axis="y", idx=0) == [0, 3]


def test_spec_row_major_layout():
    """axes=['x', 'y'] makes (x, y) and (x, y+1) adjacent; axes=['y', 'x'] makes (x, y) and (x+1, y) adjacent."""
    xy = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    yx = ProcessTopology(axes=["y", "x"], dims=[3, 2])
    assert xy.get_rank(x=1, y=2) - xy.get_rank(x=1, y=1) == 1
    assert yx.get_rank(x=1, y=2) - yx.get_rank(x=0, y=2) == 1


# --- the rest of the surface ---


def test_axis_names_world_size_and_str():
    X = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert X.get_axis_names() == ["x", "y"]
    assert X.world_size() == 6
    assert str(X).startswith("{ProcessCoord(x=0, y=0): 0, ProcessCoord(x=0, y=1): 1,")
    assert str(X).endswith("ProcessCoord(x=1, y=2): 5}")
    assert repr(X) == "ProcessTopology(axes=['x', 'y'], dims=[2, 3])"


def test_missing_axes_are_harmless_where_deepspeed_allows_it():
    """get_dim and get_axis_comm_lists of an absent axis give 0 and [] (hybrid-parallel code asks for any)."""
    X = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert X.get_dim("model") == 0
    assert X.get_axis_comm_lists("model") == []


def test_get_rank_repr_defaults_omit_data_and_pipe():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_rank_repr(rank=5) == "model_01"
    assert topo.get_rank_repr(rank=5, omit_axes=[]) == "pipe_01-data_00-model_01"
    assert topo.get_rank_repr(rank=6, omit_axes=["model"], inner_sep=":", outer_sep="/") == "pipe:01/data:01"
    assert PipeDataParallelTopology(2, 2).get_rank_repr(rank=3) == ""


def test_pipe_data_parallel_topology():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert topo.get_axis_names() == ["pipe", "data"]
    assert (topo.get_dim("pipe"), topo.get_dim("data")) == (2, 3)
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]  # data peers are adjacent ranks
    assert topo.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]


def test_pipe_model_data_parallel_topology():
    """Arguments (num_pp, num_mp, num_dp), axes ['pipe', 'data', 'model']: tensor slices are adjacent."""
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=3, num_dp=4)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert [topo.get_dim(a) for a in ("pipe", "data", "model")] == [2, 4, 3]
    assert topo.get_axis_comm_lists("model")[0] == [0, 1, 2]
    assert topo.get_coord(13) == topo.ProcessCoord(pipe=1, data=0, model=1)


def _reference_rank(dims: list[int], coord: tuple[int, ...]) -> int:
    """Row-major linear index, written out: the last axis varies fastest."""
    rank = 0
    for size, c in zip(dims, coord, strict=True):
        rank = rank * size + c
    return rank


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_layout_matches_a_reference(dims):
    axes = [f"a{i}" for i in range(len(dims))]
    topo = ProcessTopology(axes, dims)
    assert topo.world_size() == math.prod(dims)
    for coord in itertools.product(*[range(d) for d in dims]):
        rank = topo.get_rank(**dict(zip(axes, coord, strict=True)))
        assert rank == _reference_rank(dims, coord)
        assert tuple(topo.get_coord(rank)) == coord
    for i, axis in enumerate(axes):
        lists = topo.get_axis_comm_lists(axis)
        assert sorted(r for group in lists for r in group) == list(range(topo.world_size()))  # a partition
        assert all(len(g) == dims[i] for g in lists)
        for group in lists:
            coords = [topo.get_coord(r) for r in group]
            assert [c[i] for c in coords] == list(range(dims[i]))
            assert len({c[:i] + c[i + 1:] for c in coords}) == 1  # equal on every other axis
        for idx in range(dims[i]):
            assert topo.get_axis_list(axis, idx) == topo.filter_match(**{axis: idx})
            assert all(topo.get_coord(r)[i] == idx for r in topo.get_axis_list(axis, idx))


def test_filter_match_without_criteria_is_every_rank():
    assert ProcessTopology(["x", "y"], [2, 2]).filter_match() == [0, 1, 2, 3]


def test_default_topology_alternates_prime_factors():
    """DeepSpeed's grid without a topology: factors of the world size go to pipe, data, pipe, ..."""
    assert _prime_factors(1) == [] and _prime_factors(12) == [2, 2, 3] and _prime_factors(97) == [97]
    with pytest.raises(ValueError, match="n=0 is invalid"):
        _prime_factors(0)
    cases = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (4, 2), 12: (6, 2), 6: (2, 3)}
    for world, (pp, dp) in cases.items():
        topo = default_topology(world)
        assert (topo.get_dim("pipe"), topo.get_dim("data")) == (pp, dp), world


# --- bad input ---


@pytest.mark.parametrize(("axes", "dims", "words"), [
    (["x", "y"], [2], ["axes ['x', 'y']", "dims [2]", "same length"]),
    (["x"], [2, 3], ["axes ['x']", "dims [2, 3]"]),
    ([], [], ["at least one axis"]),
    (["x", "x"], [2, 2], ["repeat"]),
    (["x", "not valid"], [2, 2], ["'not valid'"]),
    (["x", "y"], [2, 0], ["'y'", "size 0"]),
    (["x", "y"], [2, 1.5], ["'y'", "size 1.5"]),
])
def test_bad_axes_or_dims(axes, dims, words):
    with pytest.raises(ValueError) as info:
        ProcessTopology(axes, dims)
    for word in words:
        assert word in str(info.value)


def test_bad_coordinates():
    X = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    with pytest.raises(ValueError, match=r"y=3 is out of range \(0..2\)"):
        X.get_rank(x=0, y=3)
    with pytest.raises(ValueError, match=r"x=-1 is out of range"):
        X.get_rank(x=-1, y=0)
    with pytest.raises(ValueError, match="does not support slices"):
        X.get_rank(x=0)
    with pytest.raises(ValueError, match="axis 'z' is not in"):
        X.get_rank(x=0, z=1)
    with pytest.raises(ValueError, match=r"rank 6 not found in topology \(ranks are 0..5\)"):
        X.get_coord(6)
    with pytest.raises(ValueError, match="rank -1 not found"):
        X.get_rank_repr(-1)
    with pytest.raises(ValueError, match="filter_match\\(\\): axis 'pipe' is not in"):
        X.filter_match(pipe=0)
    with pytest.raises(ValueError, match="get_axis_list\\(\\): axis 'data'"):
        X.get_axis_list("data", 0)


def test_topologies_pickle():
    import pickle

    for topo in (ProcessTopology(["x", "y"], [2, 3]), PipeModelDataParallelTopology(2, 3, 1)):
        back = pickle.loads(pickle.dumps(topo))
        assert type(back) is type(topo) and back.axes == topo.axes and back.dims == topo.dims
        assert back.get_axis_comm_lists(topo.axes[0]) == topo.get_axis_comm_lists(topo.axes[0])

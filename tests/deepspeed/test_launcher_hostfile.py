"""Hostfile parsing and --include/--exclude filtering of the deepspeed launcher."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepspeed.launcher._hostfile import HostfileError, decode_world_info
from deepspeed.launcher.runner import (
    _parse_hostfile,
    encode_world_info,
    fetch_hostfile,
    parse_inclusion_exclusion,
    parse_resource_filter,
)

POOL = collections.OrderedDict([("worker-0", 4), ("worker-1", 4), ("worker-2", 2)])


def test_fetch_hostfile_reads_hosts_in_order(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# cluster\nworker-1 slots=2\n\n  worker-0   slots=4   # big one\n10.0.0.3 slots=1 max_slots=2\n")
    pool = fetch_hostfile(str(path))
    assert list(pool.items()) == [("worker-1", 2), ("worker-0", 4), ("10.0.0.3", 1)]


def test_missing_hostfile_returns_none(tmp_path):
    assert fetch_hostfile(str(tmp_path / "nope")) is None


@pytest.mark.parametrize(
    "line, why",
    [
        ("worker-0", "expected 'HOSTNAME slots=N"),
        ("worker-0 slots=", "is not a positive integer"),
        ("worker-0 slots=four", "is not a positive integer"),
        ("worker-0 slots=0", "is not a positive integer"),
        ("worker-0 slots=-2", "is not a positive integer"),
        ("worker-0 gpus=4", "unexpected 'gpus=4'"),
        ("worker-0 4", "unexpected '4'"),
        ("worker-0 max_slots=4", "missing slots=N"),
        ("worker-0 slots=2 slots=3", "unexpected 'slots=3'"),
        ("work{er} slots=2", "expected 'HOSTNAME slots=N"),
    ],
)
def test_bad_hostfile_line_is_quoted(tmp_path, line, why):
    path = tmp_path / "hostfile"
    path.write_text(f"worker-9 slots=1\n{line}\n")
    with pytest.raises(HostfileError) as err:
        fetch_hostfile(str(path))
    msg = str(err.value)
    assert repr(line) in msg and why in msg and f"{path}:2" in msg


def test_duplicate_host_is_an_error():
    with pytest.raises(HostfileError, match=r"hostfile:2: host 'a' is listed twice \(line 'a slots=2'\)"):
        _parse_hostfile(["a slots=1\n", "a slots=2\n"])


@pytest.mark.parametrize("lines", [[], ["# only a comment\n", "   \n"]])
def test_empty_hostfile_is_an_error(lines):
    with pytest.raises(HostfileError, match="hostfile is empty"):
        _parse_hostfile(lines)


def test_hostfile_error_is_a_value_error():
    assert issubclass(HostfileError, ValueError)


@pytest.mark.parametrize(
    "include, expected",
    [
        ("worker-0", {"worker-0": [0, 1, 2, 3]}),
        ("worker-1:0", {"worker-1": [0]}),
        ("worker-0@worker-1:0,2", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
        # hostfile order of hosts kept; slots sorted and deduplicated as DeepSpeed's parse_resource_filter
        ("worker-2@worker-0:3,1", {"worker-0": [1, 3], "worker-2": [0, 1]}),
        ("worker-1:2,2,0", {"worker-1": [0, 2]}),
        ("worker-1:3@worker-1:0", {"worker-1": [0, 3]}),
        ("worker-1:0@worker-1:3", {"worker-1": [0, 3]}),
    ],
)
def test_include(include, expected):
    active = parse_inclusion_exclusion(POOL, include, "")
    assert list(active.items()) == list(expected.items())


@pytest.mark.parametrize(
    "exclude, expected",
    [
        ("worker-1", {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ("worker-1:0", {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3], "worker-2": [0, 1]}),
        ("worker-0:0,1,2,3@worker-2:1", {"worker-1": [0, 1, 2, 3], "worker-2": [0]}),  # empty host dropped
    ],
)
def test_exclude(exclude, expected):
    active = parse_inclusion_exclusion(POOL, "", exclude)
    assert list(active.items()) == list(expected.items())


def test_no_filter_expands_slots():
    assert parse_inclusion_exclusion({"a": 2}, "", "") == {"a": [0, 1]}


@pytest.mark.parametrize(
    "include, exclude, match",
    [
        ("worker-0", "worker-1", "mutually exclusive"),
        ("worker-7", "", "hostname 'worker-7' in 'worker-7' not found in hostfile"),
        ("", "worker-1:9", "no slot 9 on host 'worker-1'"),
        ("worker-1:a", "", "bad slot 'a' in node spec 'worker-1:a' of 'worker-1:a'"),
        ("worker-1:", "", "bad node spec 'worker-1:' in 'worker-1:'"),
        ("worker-0@@worker-1", "", "bad node spec '' in 'worker-0@@worker-1'"),
        ("worker-1:0:1", "", "bad node spec 'worker-1:0:1'"),
        (":0", "", "bad node spec ':0'"),
        ("worker-1:0,,1", "", "bad slot ''"),
    ],
)
def test_bad_specs(include, exclude, match):
    with pytest.raises(HostfileError, match=match):
        parse_inclusion_exclusion(POOL, include, exclude)


def test_parse_resource_filter_takes_slot_lists():
    hosts = {"a": [0, 1, 2], "b": [5, 7]}
    assert parse_resource_filter(hosts, include_str="b:7") == {"b": [7]}
    assert parse_resource_filter(hosts, include_str="a:2,0@b:7,5") == {"a": [0, 2], "b": [5, 7]}  # sorted
    assert parse_resource_filter(hosts, exclude_str="a:1") == {"a": [0, 2], "b": [5, 7]}
    assert parse_resource_filter(hosts) == hosts


def test_world_info_round_trip():
    info = collections.OrderedDict([("z", [1, 3]), ("a", [0])])
    decoded = decode_world_info(encode_world_info(info))
    assert list(decoded.items()) == list(info.items())
    with pytest.raises(HostfileError, match="not base64 JSON"):
        decode_world_info("%%%")


_host = st.from_regex(r"[a-z][a-z0-9\-]{0,8}", fullmatch=True)


@given(st.dictionaries(_host, st.integers(1, 6), min_size=1, max_size=5), st.data())
def test_include_then_exclude_partition_the_pool(pool, data):
    """Property: for any selection, include(sel) and exclude(sel) split every host's slots between them."""
    spec_parts = []
    for host in data.draw(st.lists(st.sampled_from(sorted(pool)), min_size=1, unique=True)):
        slots = data.draw(st.lists(st.integers(0, pool[host] - 1), unique=True))
        spec_parts.append(host + (":" + ",".join(map(str, slots)) if slots else ""))
    spec = "@".join(spec_parts)
    included = parse_inclusion_exclusion(pool, spec, "")
    excluded = parse_inclusion_exclusion(pool, "", spec)
    for host, n in pool.items():
        assert sorted(included.get(host, []) + excluded.get(host, [])) == list(range(n))
    assert list(included) == [h for h in pool if h in included]  # hostfile order


@given(st.text(max_size=40))
def test_arbitrary_hostfile_text_parses_or_raises_hostfile_error(text):
    try:
        pool = _parse_hostfile(text.splitlines())
    except HostfileError:
        return
    assert pool and all(isinstance(n, int) and n > 0 for n in pool.values())


@given(st.text(alphabet="w-01:,@ ab", max_size=30), st.booleans())
def test_arbitrary_specs_filter_or_raise_hostfile_error(spec, as_exclude):
    pool = {"w-0": 2, "w-1": 3, "ab": 1}
    try:
        active = parse_inclusion_exclusion(pool, "" if as_exclude else spec, spec if as_exclude else "")
    except HostfileError as err:
        assert repr(spec) in str(err) or "mutually exclusive" in str(err)
        return
    for host, slots in active.items():
        assert slots and set(slots) <= set(range(pool[host]))


@given(st.dictionaries(st.from_regex(r"[a-z0-9][a-z0-9.\-]{0,12}", fullmatch=True), st.integers(1, 64),
                       min_size=1, max_size=8))
def test_written_hostfile_round_trips(pool):
    text = "".join(f"{host} slots={n}  # node\n" for host, n in pool.items())
    assert list(_parse_hostfile(text.splitlines(keepends=True)).items()) == list(pool.items())

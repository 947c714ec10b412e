"""Random corruption of a valid config section, and the checks every section's tests make on the result.

The promise under test: whatever a user breaks, validation answers with a ``ConfigError`` whose paths name
where the problem is (inside the section), never with another exception.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ds_config._base import DeprecatedConfigWarning
from ds_config._errors import ConfigError

# Values of every JSON-ish kind (and NaN), so each field sees a wrong type as well as a wrong value.
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True), st.text(max_size=8),
                 st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))

CORRUPTION_SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def key_paths(node: object, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key path in a nested dict/list tree, parents before children (list items by index)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield prefix + (key,)
        yield from key_paths(value, prefix + (key,))


def _corrupt(data: st.DataObject, example: dict) -> dict:
    """A deep copy of ``example`` with one to three values replaced by junk, half of them under a typo'd key."""
    config = copy.deepcopy(example)
    for _ in range(data.draw(st.integers(1, 3))):
        *parents, leaf = data.draw(st.sampled_from(list(key_paths(config)) or [("x",)]))
        node = config
        for part in parents:
            node = node[part]
        if isinstance(node, dict) and data.draw(st.booleans()):
            leaf = f"{leaf}_typo"  # an unknown key next to a known one
        node[leaf] = data.draw(JUNK)
    return config


def assert_corruption_is_a_config_error(data: st.DataObject, example: dict, parse: Callable[[dict], object],
                                        prefix: str) -> None:
    """Corrupt ``example`` at random and parse it: it is accepted, or refused with paths under ``prefix``."""
    config = _corrupt(data, example)
    try:
        parse(config)
    except ConfigError as err:
        assert err.paths and all(p.startswith(prefix) for p in err.paths)


def config_error(parse: Callable[[object], object], data: object) -> ConfigError:
    """The ConfigError ``parse(data)`` must raise (deprecation warnings silenced: they are tested elsewhere)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecatedConfigWarning)
        with pytest.raises(ConfigError) as info:
            parse(data)
    return info.value


def schema_property_names(*schemas: dict) -> set[str]:
    """Every name listed under a ``properties`` mapping anywhere in the given JSON schemas."""
    names: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            names.update((node.get("properties") or {}).keys())
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for schema in schemas:
        walk(schema)
    return names

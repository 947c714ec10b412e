"""Helpers shared by the ds-config tests.

A package under ``tests/`` (``pytest.ini`` puts ``tests/`` on ``sys.path``) so test modules can write
``from _ds_config_testing import ...`` without a conftest or loading files by path; the name is prefixed
so it cannot clash with another package's test helpers.
"""

from __future__ import annotations

from _ds_config_testing.corruption import (
    CORRUPTION_SETTINGS,
    JUNK,
    assert_corruption_is_a_config_error,
    config_error,
    key_paths,
    schema_property_names,
)

__all__ = [
    "CORRUPTION_SETTINGS",
    "JUNK",
    "assert_corruption_is_a_config_error",
    "config_error",
    "key_paths",
    "schema_property_names",
]

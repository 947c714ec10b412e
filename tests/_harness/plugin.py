"""pytest plugin of the harness (``tests/conftest.py`` imports it; other sessions use ``-p _harness.plugin``).

* fixture ``distributed``: :func:`run_distributed`, for tests that prefer a fixture to an import;
* as soon as a collected test uses the harness, the forkserver starts importing torch in the background
  while pytest goes on collecting (it would otherwise do so when the first distributed test runs);
* at session end the idle rank workers are stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from _harness._decorator import WORLD_SIZE_PARAM
from _harness._pool import get_pool, shutdown_pool
from _harness._runner import run_distributed


@pytest.fixture
def distributed() -> Callable[..., list[Any]]:
    """:func:`_harness.run_distributed`."""
    return run_distributed


_checked_modules: set[int] = set()
_prestarted = False


def _uses_harness(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    if WORLD_SIZE_PARAM in names or "distributed" in names:
        return True
    module = getattr(item, "module", None)
    if module is None or id(module) in _checked_modules:
        return False
    _checked_modules.add(id(module))
    return any(value is run_distributed for value in vars(module).values())


def pytest_itemcollected(item: pytest.Item) -> None:
    # As soon as one collected test uses the harness, so the forkserver's torch import overlaps with the
    # collection of the remaining test modules.
    global _prestarted
    if not _prestarted and not item.config.option.collectonly and _uses_harness(item):
        _prestarted = True
        get_pool().prestart()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pool()

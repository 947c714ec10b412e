"""Where the reference documents (the spec) are, for every test that reads them: ONE place, no absolute paths.

The spec sits next to the checkout, ``<repository root>/../shared/spec``; the environment variable ``DS_SPEC_DIR``
points elsewhere. ``require_spec("api-reference.txt")`` returns the directory, or, when it or a named file is
missing, fails the test (or the module, at import time) in CI (``CI`` set to ``true``/``1``) and skips it with the
reason everywhere else. ``pytest.ini`` puts ``tests/`` on ``sys.path``: ``from _spec_docs import require_spec``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "DS_SPEC_DIR"


def spec_dir() -> Path:
    """The spec directory, whether it exists or not: ``$DS_SPEC_DIR``, else ``<repo>/../shared/spec``."""
    override = os.environ.get(ENV_VAR, "").strip()
    return Path(override).expanduser().resolve() if override else REPO_ROOT.parent / "shared" / "spec"


def in_ci() -> bool:
    """True where a missing spec is a failure: CI services set ``CI=true``."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_spec(*names: str) -> Path:
    """The spec directory holding every file in ``names``; otherwise fail in CI, skip locally.

    Works inside a test and at module level (a module that builds its parameters from the spec): the skip
    then skips the whole module, and the failure is a collection error, which fails the run.
    """
    where = spec_dir()
    missing = [name for name in names if not (where / name).is_file()] if where.is_dir() else []
    if where.is_dir() and not missing:
        return where
    what = f"{', '.join(missing)} not found in {where}" if missing else f"spec directory {where} not found"
    reason = (f"reference documents needed: {what} (expected at <repository root>/../shared/spec, or set "
              f"{ENV_VAR})")
    if in_ci():
        pytest.fail(f"{reason}; CI=true, so this is a failure, not a skip", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
    raise AssertionError("unreachable")  # pytest.skip raises

"""Running ``_probe_imports.py`` in an interpreter and judging which of the imports failed."""

from __future__ import annotations

import json
import subprocess
import tempfile
import warnings
from pathlib import Path

from architecture._workspace import Distribution
from packaging.utils import canonicalize_name

PROBE = Path(__file__).with_name("_probe_imports.py")


def run_probe(python: str, import_name: str, modules: list[str], timeout_s: float = 300) -> dict:
    """Import ``modules`` (of package ``import_name``) one by one in a fresh ``python -I``; the report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [python, "-I", str(PROBE), str(out), import_name, *modules]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout_s)
        assert proc.returncode == 0 and out.is_file(), f"import probe of {import_name} crashed:\n{proc.stderr[-4000:]}"
        return json.loads(out.read_text())


def extra_providing(dist: Distribution, missing: str | None) -> str | None:
    """The optional extra of ``dist`` that declares the missing module's distribution, if any."""
    if not missing:
        return None
    wanted = canonicalize_name(missing.partition(".")[0])
    for extra, reqs in dist.extras.items():
        if wanted in {canonicalize_name(r.name) for r in reqs}:
            return extra
    return None


def failed_imports(dist: Distribution, report: dict) -> list[str]:
    """Modules of a probe report that did not import, with their traceback.

    A module may fail only for a missing optional dependency that the distribution declares as an extra
    (reported as a warning, so it is visible, not silent); a ``__main__`` module may exit (its CLI ran
    with ``--help``).
    """
    failures = []
    for module, entry in report["modules"].items():
        error = entry.get("error")
        if error is None and ("exit" not in entry or module.endswith("__main__")):
            continue
        extra = extra_providing(dist, (error or {}).get("missing"))
        if extra is not None:
            warnings.warn(f"{module} not imported: optional extra [{extra}] is not installed", stacklevel=2)
            continue
        failures.append(f"{module}: {error['traceback'] if error else 'SystemExit ' + entry['exit']}")
    return failures

"""Import modules one by one in this fresh interpreter and report what each one pulled in.

Run by test_dependency_graph.py as ``python -I _probe_imports.py OUT.json PACKAGE MODULE...``. For every
module it records the top-level packages that appeared in ``sys.modules`` during its import (directly or
through other packages), the top-level packages that code of PACKAGE itself imported (an ``import``
statement or ``importlib.import_module`` call whose caller is a PACKAGE module, whether or not the target
was already loaded), the file the module was loaded from, and the error if the import failed.
``__main__`` modules are imported with ``--help`` as argv, so a CLI that runs on import prints its usage
(to stderr) and does no work.
"""

import builtins
import contextlib
import importlib
import json
import sys
import traceback
from pathlib import Path

_direct: dict[str, str] = {}  # top-level package -> first PACKAGE module that imported it


def _top_levels() -> set[str]:
    return {name.partition(".")[0] for name in list(sys.modules)}


def _watch(own: str) -> None:
    """Record the absolute imports made by the modules of package ``own``."""
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def note(importer: object, name: str, level: int) -> None:
        if level == 0 and isinstance(importer, str) and importer.partition(".")[0] == own:
            _direct.setdefault(name.partition(".")[0], importer)

    def traced_import(name, globals=None, locals=None, fromlist=(), level=0):
        note((globals or {}).get("__name__"), name, level)
        return real_import(name, globals, locals, fromlist, level)

    def traced_import_module(name, package=None):
        note(sys._getframe(1).f_globals.get("__name__"), name, 1 if name.startswith(".") else 0)
        return real_import_module(name, package)

    builtins.__import__, importlib.import_module = traced_import, traced_import_module


def _probe(name: str) -> dict:
    before, direct_before = _top_levels(), set(_direct)
    entry: dict = {}
    if name.rpartition(".")[2] == "__main__":
        sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            module = importlib.import_module(name)
        entry["file"] = getattr(module, "__file__", None)
    except SystemExit as exc:
        entry["exit"] = repr(exc.code)
    except Exception as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        entry["error"] = {"type": type(exc).__name__, "missing": missing, "traceback": traceback.format_exc()}
    entry["new"] = sorted(_top_levels() - before)
    entry["direct"] = sorted(set(_direct) - direct_before)
    return entry


def _file_of(top: str) -> str | None:
    return getattr(sys.modules.get(top), "__file__", None)


def main(out: str, package: str, modules: list[str]) -> None:
    report = {"baseline": sorted(_top_levels()), "modules": {}}
    _watch(package)
    for name in modules:
        report["modules"][name] = _probe(name)
    report["files"] = {top: _file_of(top) for top in _top_levels()}
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

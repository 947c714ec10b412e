"""The dependency direction (README: Packages) for imports the import probe cannot see: inside functions, strings.

``test_dependency_graph`` imports every module and looks at ``sys.modules``; an ``import torch`` or
``import ds_zero`` inside a function body runs only when that function is called, so it slips past. This test
reads every source file's syntax tree instead and holds each import statement (and each
``importlib.import_module("literal")`` call) to the same rules. Imports under ``if TYPE_CHECKING:`` never run
and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from architecture._module_graph import runtime_nodes
from architecture._workspace import by_name, distributions, our_import_names
from architecture.test_dependency_graph import RULES

NAMES = [d.name for d in distributions()]


def imported_top_levels(source: str) -> set[str]:
    """Top-level package names a module's source imports at run time, wherever the import statement is."""
    found: set[str] = set()
    for node in runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and not node.args[0].value.startswith(".")):
            found.add(node.args[0].value.partition(".")[0])
    return found


def _violations(name: str) -> list[str]:
    dist, rule, ours = by_name()[name], RULES[name], our_import_names()
    out = []
    for file in sorted(dist.src_dir.rglob("*.py")):
        for top in sorted(imported_top_levels(file.read_text(encoding="utf-8"))):
            sibling = ours.get(top)
            where = file.relative_to(dist.src_dir.parent)
            if top == "torch" and not rule.torch:
                out.append(f"{where} imports torch: {name} must not use torch (README: Packages)")
            elif sibling is not None and sibling != name and sibling not in rule.siblings:
                out.append(f"{where} imports {top}: {name} may not depend on {sibling} (README: Packages)")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_no_import_statement_breaks_the_dependency_rules(name):
    assert _violations(name) == []


def test_the_scan_sees_imports_the_probe_cannot(tmp_path: Path):
    source = (
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "if TYPE_CHECKING:\n    import numpy\n"
        "def lazy():\n    import torch.nn\n    from ds_zero import x\n"
        "    return importlib.import_module('ds_pipe.engine')\n"
        "class K:\n    def m(self):\n        __import__('ds_moe')\n"
        "from . import sibling\n"
    )
    assert imported_top_levels(source) == {"typing", "importlib", "torch", "ds_zero", "ds_pipe", "ds_moe"}

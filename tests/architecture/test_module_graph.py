"""The import graph inside each distribution stays a one-way street, and private modules stay private.

Two rules, read from the source of every module (``_module_graph``; imports inside functions count, imports under
``if TYPE_CHECKING:`` do not):

1. No import circle between modules of one distribution. A circle means neither module can be understood, tested
   or moved without the other; break it by moving the piece both need down into a module they can both import (a
   constants, types or errors module), not by hiding the import inside a function.
2. A private module (``_name``, or anything inside a package ``_name``) belongs to the folder that holds it: only
   the modules of that folder may import it. Code in any other folder, above, beside or below, or in another
   distribution, goes through the public face: the package's ``__init__`` or a public module.
"""

from __future__ import annotations

import ast

import pytest
from architecture._module_graph import ModuleGraph, circles, module_graph, private_imports, runtime_nodes
from architecture._workspace import by_name, distributions, our_import_names

NAMES = [d.name for d in distributions()]

CIRCLE_RULE = ("an import circle between modules of one distribution: move the piece both sides need down into a "
               "module they can both import (constants, types, errors); importing inside a function does not "
               "break a circle, it hides it")
PRIVATE_RULE = ("a private module (_name) belongs to its folder: modules elsewhere, above, beside, below or in "
                "another distribution, import the package's __init__ or a public module; give a shared helper a "
                "public name in the folder of its users, or export it from the package")


@pytest.mark.parametrize("name", NAMES)
def test_no_import_circles(name):
    found = circles(module_graph(by_name()[name]))
    assert not found, f"{CIRCLE_RULE}:\n" + "\n".join("  " + " -> ".join(c) for c in found)


@pytest.mark.parametrize("name", NAMES)
def test_private_modules_stay_in_their_folder(name):
    found = private_imports(module_graph(by_name()[name]))
    assert not found, f"{PRIVATE_RULE}:\n" + "\n".join("  " + line for line in found)


def _foreign_private_imports(name: str) -> list[str]:
    """Imports of another distribution's private modules (``ds_zero._x``, ``ds_zero.zero3._y``)."""
    dist, ours = by_name()[name], our_import_names()
    out = []
    for path in sorted(dist.src_dir.rglob("*.py")):
        for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                if parts[0] == dist.import_name or parts[0] not in ours:
                    continue
                private = _private_module(parts)
                if private:
                    out.append(f"{path.relative_to(dist.src_dir.parent)} imports {private}")
    return sorted(set(out))


def _private_module(parts: list[str]) -> str | None:
    """The private *module* a dotted name reaches into, if any (a private name imported from a public module
    is the importer's business: ``from ds_x.mod import _helper`` is for review, not for this rule)."""
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[: i + 1]) if _is_module(parts[: i + 1]) else None
    return None


def _is_module(parts: list[str]) -> bool:
    dist = next(d for d in distributions() if d.import_name == parts[0])
    base = dist.src_dir.parent.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


@pytest.mark.parametrize("name", NAMES)
def test_no_private_module_of_another_distribution(name):
    found = _foreign_private_imports(name)
    assert not found, f"{PRIVATE_RULE}:\n" + "\n".join("  " + line for line in found)


def _graph(sources: dict[str, str]) -> ModuleGraph:
    """A graph of made-up modules (``pkg.a`` -> source), to check the rules themselves."""
    from pathlib import Path

    files = {name: Path(name.replace(".", "/") + ".py") for name in sources}
    packages = {name for name in sources if any(other.startswith(name + ".") for other in sources)}
    graph = ModuleGraph(files, packages)
    from architecture._module_graph import _targets

    for module, source in sources.items():
        edges: set[str] = set()
        for node in runtime_nodes(ast.parse(source)):
            edges |= _targets(graph, module, node)
        graph.edges[module] = edges
    return graph


def test_the_rules_catch_what_they_describe():
    graph = _graph({
        "pkg": "",
        "pkg.a": "def f():\n    from pkg import b\n",  # hidden in a function: still an edge
        "pkg.b": "import pkg.a\n",
        "pkg._shared": "",
        "pkg.c": "from pkg import _shared\n",  # same folder: allowed
        "pkg.sub": "",
        "pkg.sub.d": "from pkg._shared import x\n",  # a folder below reaching up: not allowed
        "pkg.sub._own": "",
        "pkg.e": "from pkg.sub import _own\n",  # reaching down into a private module: not allowed
        "pkg.f": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import _own\n",
    })
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert private_imports(graph) == ["pkg.e imports pkg.sub._own", "pkg.sub.d imports pkg._shared"]

"""The import graph between the modules of one distribution, read from the source (nothing is imported).

An edge ``a -> b`` means a statement in module ``a`` imports module ``b``, wherever the statement sits
(module level or inside a function: hiding an import in a function does not remove the dependency). Imports
under ``if TYPE_CHECKING:`` never run and are not edges. ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``). Importing ``a.b.c`` also runs the
``__init__`` of ``a`` and ``a.b``, but those implicit edges are left out: every package whose ``__init__``
re-exports its children would otherwise be a circle with each child.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from pathlib import Path

from architecture._workspace import Distribution


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (its ``else`` branch does run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


@dataclass
class ModuleGraph:
    """Modules of one distribution (dotted names) and the import edges between them."""

    files: dict[str, Path]
    packages: set[str]
    edges: dict[str, set[str]] = field(default_factory=dict)

    def is_private(self, module: str, below: str) -> bool:
        """Whether ``module`` has a private part (``_name``) under package ``below``."""
        rest = module[len(below) + 1:].split(".") if module != below else []
        return any(part.startswith("_") and not part.startswith("__") for part in rest)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(graph: ModuleGraph, module: str, node: ast.AST) -> set[str]:
    known = graph.files
    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(module, module in graph.packages, node)
        for alias in node.names:
            if f"{base}.{alias.name}" in known:
                found.add(f"{base}.{alias.name}")
            else:
                name = base
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name:
                    found.add(name)
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        called = getattr(func, "attr", getattr(func, "id", None))
        value = node.args[0].value
        if called in ("import_module", "__import__") and isinstance(value, str) and value in known:
            found.add(value)
    found.discard(module)
    return found


def module_graph(dist: Distribution) -> ModuleGraph:
    return _graph_of(dist.src_dir)


@functools.cache
def _graph_of(src_dir: Path) -> ModuleGraph:
    files: dict[str, Path] = {}
    packages: set[str] = set()
    for path in sorted(src_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(src_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
            packages.add(".".join(parts))
        files[".".join(parts)] = path
    graph = ModuleGraph(files, packages)
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        edges: set[str] = set()
        for node in runtime_nodes(tree):
            edges |= _targets(graph, module, node)
        graph.edges[module] = edges
    return graph


def circles(graph: ModuleGraph) -> list[list[str]]:
    """Every strongly connected component with more than one module, each as one closed path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    counter = 0
    for root in sorted(graph.edges):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_closed_path(graph, c) for c in sorted(components, key=min)]


def _closed_path(graph: ModuleGraph, component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.edges[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return sorted(component)


def private_imports(graph: ModuleGraph) -> list[str]:
    """Imports of a private module (``_x``, or anything inside a package ``_x``) from outside its folder.

    ``pkg/_x.py`` belongs to the modules of ``pkg/`` itself (and ``pkg/_x/`` to the modules inside it). A
    module in another folder, above, beside or below, goes through the public face: ``pkg/__init__`` or
    a public module of ``pkg``.
    """
    out = []
    for module in sorted(graph.edges):
        folder = module if module in graph.packages else module.rpartition(".")[0]
        for target in sorted(graph.edges[module]):
            parts = target.split(".")
            private = [i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")]
            if not private:
                continue
            owner, inside = ".".join(parts[: private[0]]), ".".join(parts[: private[0] + 1])
            if folder != owner and folder != inside and not folder.startswith(inside + "."):
                out.append(f"{module} imports {target}")
    return out

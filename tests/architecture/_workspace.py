"""Discovery of the monorepo's distributions, read from disk at test time (nothing hard-coded).

Every ``packages/<dist>/pyproject.toml`` is one distribution; its import package is the single entry of
``tool.hatch.build.targets.wheel.packages`` (``src/<import>``) and its version the ``__version__`` literal
in ``src/<import>/__about__.py`` (parsed, not imported, so a broken package still gets reported).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PACKAGES = REPO / "packages"


@dataclass(frozen=True)
class Distribution:
    """One hatch distribution of the workspace."""

    root: Path
    pyproject: dict

    @property
    def name(self) -> str:
        return canonicalize_name(self.pyproject["project"]["name"])

    @property
    def wheel_packages(self) -> list[str]:
        return (
            self.pyproject.get("tool", {})
            .get("hatch", {})
            .get("build", {})
            .get("targets", {})
            .get("wheel", {})
            .get("packages", [])
        )

    @property
    def import_name(self) -> str:
        return Path(self.wheel_packages[0]).name if self.wheel_packages else self.name.replace("-", "_")

    @property
    def src_dir(self) -> Path:
        return self.root / "src" / self.import_name

    @property
    def about_file(self) -> Path:
        return self.src_dir / "__about__.py"

    @property
    def version(self) -> str | None:
        """``__version__`` of ``__about__.py``, or None when the file or the assignment is missing."""
        if not self.about_file.is_file():
            return None
        for node in ast.parse(self.about_file.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    return node.value.value
        return None

    @property
    def dependencies(self) -> list[Requirement]:
        return [Requirement(r) for r in self.pyproject["project"].get("dependencies", [])]

    @property
    def extras(self) -> dict[str, list[Requirement]]:
        table = self.pyproject["project"].get("optional-dependencies", {})
        return {extra: [Requirement(r) for r in reqs] for extra, reqs in table.items()}

    def modules(self) -> list[str]:
        """Every importable module of the source tree, parents before children."""
        names = []
        for path in sorted(self.src_dir.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(self.src_dir.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join(parts))
        return sorted(set(names), key=lambda n: (n.count("."), n))


@functools.cache
def distributions() -> tuple[Distribution, ...]:
    """All distributions under packages/, sorted by name."""
    found = []
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        with pyproject.open("rb") as fh:
            found.append(Distribution(pyproject.parent, tomllib.load(fh)))
    return tuple(sorted(found, key=lambda d: d.name))


def by_name() -> dict[str, Distribution]:
    return {d.name: d for d in distributions()}


def our_import_names() -> dict[str, str]:
    """Import name -> distribution name, for every distribution of the workspace."""
    return {d.import_name: d.name for d in distributions()}


def sibling_requirements(reqs: Iterable[Requirement]) -> dict[str, Requirement]:
    """The requirements among ``reqs`` that name a distribution of this workspace."""
    ours = by_name()
    return {canonicalize_name(r.name): r for r in reqs if canonicalize_name(r.name) in ours}


def _installed_requires(name: str, extra: str) -> list[Requirement]:
    try:
        raw = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return []  # an optional dependency that this environment does not have
    reqs = [Requirement(r) for r in raw]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": extra})]


def requirement_closure(reqs: Iterable[Requirement]) -> set[str]:
    """Canonical names of every distribution that ``reqs`` pull in, transitively.

    Our own distributions contribute the dependencies their pyproject declares; third-party ones those
    of their installed metadata (with markers evaluated for this interpreter and the requested extras).
    """
    ours = by_name()
    seen: set[tuple[str, str]] = set()
    stack = [(r, extra) for r in reqs for extra in ("", *r.extras)]
    while stack:
        req, extra = stack.pop()
        key = (canonicalize_name(req.name), extra)
        if key in seen:
            continue
        seen.add(key)
        if key[0] in ours:
            dist = ours[key[0]]
            children = dist.dependencies if not extra else dist.extras.get(extra, [])
        else:
            children = _installed_requires(key[0], extra)
        stack.extend((child, e) for child in children for e in ("", *child.extras))
    return {name for name, _ in seen}

"""The dependency direction between the distributions (README: Packages) holds, declared and at import time.

Every module of every distribution is imported (one fresh interpreter per distribution) and the top-level
packages that appear in ``sys.modules`` are checked against the rules below and against what the
distribution's pyproject.toml declares. The rules are the only hard-coded part; distributions and modules
are discovered on disk.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
from architecture._imports import failed_imports, run_probe
from architecture._workspace import (
    by_name,
    distributions,
    our_import_names,
    requirement_closure,
    sibling_requirements,
)
from packaging.utils import canonicalize_name


@dataclass(frozen=True)
class Rule:
    """What a distribution may depend on: which siblings, and whether torch (base dependency or import)."""

    siblings: frozenset[str]
    torch: bool


_COMPONENTS = ("ds-config", "ds-ops", "ds-zero", "ds-pipe", "ds-moe", "ds-profiler", "ds-monitor", "ds-inference")
RULES: dict[str, Rule] = {
    "ds-config": Rule(frozenset(), torch=False),
    "ds-profiler": Rule(frozenset(), torch=True),
    "ds-ops": Rule(frozenset(), torch=True),
    "ds-monitor": Rule(frozenset({"ds-config"}), torch=False),
    "ds-zero": Rule(frozenset({"ds-config", "ds-ops"}), torch=True),
    "ds-pipe": Rule(frozenset({"ds-config"}), torch=True),
    "ds-moe": Rule(frozenset({"ds-config"}), torch=True),
    "ds-inference": Rule(frozenset({"ds-config"}), torch=True),
    "deepspeed": Rule(frozenset(_COMPONENTS), torch=True),
}
NAMES = [d.name for d in distributions()]


@functools.cache
def probe(name: str) -> dict:
    """Import every module of distribution ``name`` in one fresh interpreter; the probe's report."""
    dist = by_name()[name]
    return run_probe(sys.executable, dist.import_name, dist.modules())


def imported_by(report: dict) -> dict[str, str]:
    """Top-level package -> first module of the distribution whose import pulled it in."""
    first: dict[str, str] = {}
    for module, entry in report["modules"].items():
        for top in entry["new"]:
            first.setdefault(top, module)
    return first


def _is_stdlib(top: str, file: str | None) -> bool:
    """Standard library, including private helpers such as ``_sysconfigdata_*`` that are not listed."""
    if top in sys.stdlib_module_names or file is None:
        return top in sys.stdlib_module_names or top in sys.builtin_module_names
    paths = sysconfig.get_paths()
    in_site = any(Path(file).is_relative_to(paths[k]) for k in ("purelib", "platlib"))
    return not in_site and any(Path(file).is_relative_to(paths[k]) for k in ("stdlib", "platstdlib"))


def test_every_distribution_has_a_rule():
    assert set(NAMES) == set(RULES), "a distribution was added or removed: update RULES and README: Packages"


@pytest.mark.parametrize("name", NAMES)
def test_declared_dependencies_follow_the_rules(name):
    dist, rule = by_name()[name], RULES[name]
    all_reqs = dist.dependencies + [r for reqs in dist.extras.values() for r in reqs]
    declared = set(sibling_requirements(all_reqs)) - {name}  # an extra may refer to its own distribution
    assert declared <= rule.siblings, f"{name} declares {sorted(declared - rule.siblings)}, not allowed (README)"
    base = {canonicalize_name(r.name) for r in dist.dependencies}
    if not rule.torch:
        assert "torch" not in base, f"{name} must not depend on torch"
    if name == "ds-config":
        assert "torch" not in {canonicalize_name(r.name) for r in all_reqs}, "ds-config must not declare torch"
    if name == "deepspeed":
        assert set(sibling_requirements(dist.dependencies)) == set(_COMPONENTS), "the meta-package needs them all"


@pytest.mark.parametrize("name", NAMES)
def test_every_module_imports(name):
    dist, report = by_name()[name], probe(name)
    assert list(report["modules"])[:1] == [dist.import_name], f"{name}: no package at {dist.src_dir}"
    failures = failed_imports(dist, report)
    assert not failures, "modules that do not import:\n" + "\n".join(failures)
    for module, entry in report["modules"].items():
        if entry.get("file"):  # None for a namespace package
            assert Path(entry["file"]).resolve().is_relative_to(dist.src_dir), (
                f"{module} was loaded from {entry['file']}, not from the workspace source {dist.src_dir}"
            )


@pytest.mark.parametrize("name", NAMES)
def test_imports_only_allowed_siblings(name):
    rule, report = RULES[name], probe(name)
    ours = our_import_names()
    declared = set(sibling_requirements(by_name()[name].dependencies))
    own = by_name()[name].import_name
    for top, module in imported_by(report).items():
        sibling = ours.get(top)
        if sibling is None or top == own:
            continue
        assert sibling in rule.siblings, f"{module} imports {top}: {name} may not depend on {sibling} (README)"
        assert sibling in declared, f"{module} imports {top} but {name} does not declare {sibling}"


@pytest.mark.parametrize("name", NAMES)
def test_torch_only_where_allowed(name):
    rule, report = RULES[name], probe(name)
    if rule.torch:
        return
    package_entry = report["modules"][by_name()[name].import_name]
    assert "torch" not in package_entry["new"], f"import {by_name()[name].import_name} imports torch"


def test_no_ds_config_module_imports_torch():
    report = probe("ds-config")
    offenders = [m for m, entry in report["modules"].items() if "torch" in entry["new"]]
    assert not offenders, f"ds_config modules that import torch: {offenders}"
    assert "torch" not in report["baseline"]


@pytest.mark.parametrize("name", NAMES)
def test_third_party_imports_are_declared(name):
    """Every non-stdlib package the distribution's own code imports comes from a declared dependency.

    Dependencies of declared dependencies count (ds-zero may use pydantic through ds-config); what a
    third-party package imports opportunistically (torch imports numpy when it is installed) does not.
    """
    dist, report = by_name()[name], probe(name)
    closure = requirement_closure(dist.dependencies + [r for reqs in dist.extras.values() for r in reqs])
    providers = importlib.metadata.packages_distributions()
    ours = our_import_names()
    undeclared = []
    for module, entry in report["modules"].items():
        for top in entry["direct"]:
            if top in ours or top == "__main__" or _is_stdlib(top, report["files"].get(top)):
                continue
            owners = {canonicalize_name(d) for d in providers.get(top, [])}
            if not owners & closure:
                undeclared.append(f"{module} imports {top} (from {sorted(owners) or 'no installed distribution'})")
    assert not undeclared, f"{name} imports what it does not declare:\n" + "\n".join(undeclared)

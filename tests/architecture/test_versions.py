"""Versions and skeleton of the workspace's distributions: each has its own version, the same skeleton and a README.

The workspace's versions must satisfy every range one distribution declares on another, those ranges
must be compatible ranges (bounded above), and every distribution has the same skeleton.
"""

from __future__ import annotations

import pytest
import tomllib
from architecture._workspace import PACKAGES, REPO, by_name, distributions, sibling_requirements
from packaging.specifiers import SpecifierSet
from packaging.version import Version

NAMES = [d.name for d in distributions()]
META = "deepspeed"
META_VERSION = "0.19.2"  # the DeepSpeed API level the meta-package serves (issue 2)
EDGES = [
    (d.name, sibling, str(req.specifier))
    for d in distributions()
    for sibling, req in sibling_requirements(d.dependencies + [r for reqs in d.extras.values() for r in reqs]).items()
    if sibling != d.name
]


def test_workspace_is_discovered():
    assert len(NAMES) >= 9 and META in NAMES, NAMES
    dirs = {p.name for p in PACKAGES.iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert dirs == {d.root.name for d in distributions()}, "every packages/* folder must be a distribution"
    assert EDGES, "no inter-package dependency found"


@pytest.mark.parametrize(("name", "sibling", "spec"), EDGES, ids=[f"{a}->{b}" for a, b, _ in EDGES])
def test_workspace_versions_satisfy_ranges(name, sibling, spec):
    version = Version(by_name()[sibling].version)
    assert version in SpecifierSet(spec), f"{name} requires {sibling}{spec} but the workspace has {version}"


@pytest.mark.parametrize(("name", "sibling", "spec"), EDGES, ids=[f"{a}->{b}" for a, b, _ in EDGES])
def test_inter_package_ranges_are_compatible_ranges(name, sibling, spec):
    """A range that admits the next minor (0.1 -> 0.2) would accept breaking changes of a 0.x component."""
    assert spec, f"{name} depends on {sibling} without a version range"
    major, minor = Version(by_name()[sibling].version).release[:2]
    next_breaking = Version(f"{major + 1}.0") if major else Version(f"0.{minor + 1}.0")
    assert next_breaking not in SpecifierSet(spec), f"{name} -> {sibling}{spec} admits {next_breaking}"


@pytest.mark.parametrize("name", NAMES)
def test_version(name):
    dist = by_name()[name]
    assert dist.version is not None, f"{dist.about_file} has no __version__ = '...' literal"
    version = Version(dist.version)
    if name == META:
        assert str(version) == META_VERSION, "the meta-package's version is the DeepSpeed API level it serves"
    else:
        assert version.release[0] == 0 and version >= Version("0.1.0"), f"{name} counts from 0.1.0: {version}"


@pytest.mark.parametrize("name", NAMES)
def test_skeleton(name):
    dist, project = by_name()[name], by_name()[name].pyproject["project"]
    assert dist.root.name == name, f"folder {dist.root.name} holds distribution {name}"
    assert dist.import_name == name.replace("-", "_"), f"{name} must be imported as {name.replace('-', '_')}"
    assert dist.wheel_packages == [f"src/{dist.import_name}"]
    assert sorted(p.name for p in (dist.root / "src").iterdir() if not p.name.startswith(".")) == [dist.import_name]
    assert (dist.src_dir / "__init__.py").is_file()
    assert project.get("dynamic") == ["version"] and "version" not in project
    assert dist.pyproject["tool"]["hatch"]["version"] == {"path": f"src/{dist.import_name}/__about__.py"}
    assert project.get("readme") == "README.md"
    readme = (dist.root / "README.md").read_text()
    assert len(readme.split()) >= 20, f"{name}/README.md needs at least a paragraph"
    assert project.get("description"), f"{name} has no description"


def _uniform(key) -> set:
    return {repr(key(d.pyproject)) for d in distributions()}


def test_same_build_system_everywhere():
    assert len(_uniform(lambda p: p["build-system"])) == 1
    assert next(iter(distributions())).pyproject["build-system"]["build-backend"] == "hatchling.build"


def test_same_python_and_license_everywhere():
    assert len(_uniform(lambda p: p["project"].get("requires-python"))) == 1
    assert len(_uniform(lambda p: p["project"].get("license"))) == 1


def test_hatch_workspace_covers_every_distribution():
    with (REPO / "hatch.toml").open("rb") as fh:
        hatch = tomllib.load(fh)
    members = hatch["envs"]["default"]["workspace"]["members"]
    covered = {p.resolve() for pattern in members for p in REPO.glob(pattern) if (p / "pyproject.toml").is_file()}
    assert covered == {d.root.resolve() for d in distributions()}

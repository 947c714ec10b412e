"""Every distribution builds a wheel that installs ALONE into a fresh virtual environment and imports there.

All wheels are built once per session (``uv build``). Each distribution then gets its own fresh venv with
only its wheel, the wheels of the siblings its metadata requires (from this workspace's build, never from
an index: PyPI has unrelated projects with some of our names) and the third-party packages its metadata
requires (resolved by uv from the configured index). torch always comes from the local CPU wheel: it is
passed by path and pinned by a constraint, so no resolution can fall back to a multi-GB CUDA build.
"""

from __future__ import annotations

import email
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from architecture._imports import failed_imports, run_probe
from architecture._workspace import by_name, distributions
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

pytestmark = pytest.mark.slow

NAMES = [d.name for d in distributions()]
META_VERSION = "0.19.2"  # the DeepSpeed API level the meta-package serves (issue 2)
_TIMEOUT_S = 600

_CHECK_SCRIPT = """
import importlib, importlib.metadata as md, json, sys
name, import_name, aliases = sys.argv[1], sys.argv[2], sys.argv[3:]
pkg = importlib.import_module(import_name)
public = getattr(pkg, "__all__", None)
report = {
    "file": pkg.__file__,
    "all": public,
    "missing": [n for n in (public or []) if not hasattr(pkg, n)],
    "module_version": getattr(pkg, "__version__", None),
    "dist_version": md.version(name),
    "installed": {d.metadata["Name"]: d.version for d in md.distributions()},
    "origins": {d.metadata["Name"]: d.read_text("direct_url.json") for d in md.distributions()},
}
report["aliases"] = {a: importlib.import_module(a).__name__ for a in aliases}
scripts = [ep for ep in md.distribution(name).entry_points if ep.group in ("console_scripts", "gui_scripts")]
report["scripts"] = {ep.name: callable(ep.load()) for ep in scripts}
print(json.dumps(report))
"""


def _uv() -> list[str]:
    if importlib.util.find_spec("uv") is not None:
        return [sys.executable, "-m", "uv"]
    exe = shutil.which("uv")
    if exe is None:
        pytest.fail("uv is needed to build and install the wheels (it is in the test environment of hatch.toml)")
    return [exe]


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _local_torch_wheel() -> Path | None:
    """The wheel of the torch this environment runs (the local CPU build), from DS_TORCH_WHEEL or find-links."""
    if os.environ.get("DS_TORCH_WHEEL"):
        return Path(os.environ["DS_TORCH_WHEEL"])
    version = importlib.metadata.version("torch")
    dirs = [*os.environ.get("PIP_FIND_LINKS", "").split(), "/opt/wheels"]
    tags = set(sys_tags())
    for folder in map(Path, dirs):
        for wheel in sorted(folder.glob("torch-*.whl")) if folder.is_dir() else []:
            name, wheel_version, _, wheel_tags = parse_wheel_filename(wheel.name)
            if name == "torch" and str(wheel_version) == version and wheel_tags & tags:
                return wheel
    return None


def _build_hook_files(table: object) -> set[str]:
    """Scripts of hatch build hooks (``hatch_build.py`` unless a hook names its ``path``): run, not shipped."""
    found = set()
    if isinstance(table, dict):
        for key, value in table.items():
            if key == "hooks" and isinstance(value, dict):
                found |= {hook.get("path", "hatch_build.py") for hook in value.values() if isinstance(hook, dict)}
            else:
                found |= _build_hook_files(value)
    return found


def _source_files(root: Path, pyproject: dict) -> list[Path]:
    """Files of a distribution folder that its wheel must ship (not build scripts or build outputs)."""
    build_only = {"pyproject.toml", "README.md", *_build_hook_files(pyproject)}
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        if rel.as_posix() in build_only or any(p.startswith(".") for p in rel.parts):
            continue
        if "__pycache__" in rel.parts or "build" in rel.parts or path.suffix in {".pyc", ".so", ".o"}:
            continue
        found.append(rel)
    return found


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> tuple[dict[str, Path], dict[str, list[Path]]]:
    """Distribution name -> its freshly built wheel, and -> its source files just before that build."""
    out = tmp_path_factory.mktemp("wheels")
    sources = {}
    for dist in distributions():
        sources[dist.name] = _source_files(dist.root, dist.pyproject)
        _run([*_uv(), "build", "--quiet", "--wheel", "--out-dir", str(out), str(dist.root)])
    wheels = {}
    for wheel in out.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        assert str(version) == by_name()[name].version, f"{wheel.name} does not carry the __about__ version"
        wheels[name] = wheel
    assert set(wheels) == set(NAMES), f"wheels built: {sorted(wheels)}"
    return wheels, sources


@pytest.fixture(scope="session")
def wheelhouse(built) -> dict[str, Path]:
    return built[0]


def _wheel_requirements(wheel: Path) -> list[Requirement]:
    """Requires-Dist of a wheel that apply without extras on this interpreter."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.message_from_bytes(zf.read(meta))
    reqs = [Requirement(r) for r in message.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _sibling_closure(name: str, wheels: dict[str, Path]) -> set[str]:
    """Our distributions that installing ``name`` requires, transitively, per the built wheels' metadata."""
    needed, stack = set(), [name]
    while stack:
        for req in _wheel_requirements(wheels[stack.pop()]):
            sibling = canonicalize_name(req.name)
            if sibling in wheels and sibling not in needed and sibling != name:
                needed.add(sibling)
                stack.append(sibling)
    return needed


def _wheel_modules(wheel: Path, import_name: str) -> list[str]:
    """Every module a wheel ships for ``import_name``, parents before children."""
    with zipfile.ZipFile(wheel) as zf:
        files = [Path(n) for n in zf.namelist() if n.startswith(f"{import_name}/") and n.endswith(".py")]
    names = {".".join(f.parts[:-1] if f.stem == "__init__" else (*f.parts[:-1], f.stem)) for f in files}
    return sorted(names, key=lambda n: (n.count("."), n))


def _install_alone(name: str, wheels: dict[str, Path], venv: Path) -> set[str]:
    """Fresh venv with ``name`` and what its metadata requires; returns the siblings installed."""
    uv, siblings = _uv(), _sibling_closure(name, wheels)
    _run([*uv, "venv", "--quiet", "--python", sys.executable, str(venv)])
    torch_wheel = _local_torch_wheel()
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={importlib.metadata.version('torch')}\n")
    cmd = [*uv, "pip", "install", "--quiet", "--no-build", "--python", str(venv / "bin" / "python")]
    cmd += ["--constraint", str(constraints)]
    needs_torch = any(
        canonicalize_name(r.name) == "torch" for n in {name, *siblings} for r in _wheel_requirements(wheels[n])
    )
    if needs_torch:
        if torch_wheel is None:
            pytest.skip("no local torch wheel matching this environment's torch (set DS_TORCH_WHEEL)")
        cmd += ["--find-links", str(torch_wheel.parent), str(torch_wheel)]
    _run([*cmd, str(wheels[name]), *(str(wheels[s]) for s in sorted(siblings))])
    return siblings


@pytest.mark.parametrize("name", NAMES)
def test_installs_alone_and_imports(name, wheelhouse, tmp_path):
    dist = by_name()[name]
    siblings = _install_alone(name, wheelhouse, tmp_path / "venv")
    aliases = []
    if name == "deepspeed":
        from deepspeed._compat_paths import COMPAT_PATHS

        aliases = sorted(COMPAT_PATHS)
    cmd = [str(tmp_path / "venv" / "bin" / "python"), "-I", "-c", _CHECK_SCRIPT, name, dist.import_name, *aliases]
    report = json.loads(_run(cmd, cwd=tmp_path).stdout)

    assert Path(report["file"]).is_relative_to(tmp_path / "venv"), f"imported from {report['file']}"
    assert report["all"] is not None, f"{dist.import_name}/__init__.py declares no __all__ (its public surface)"
    assert not report["missing"], f"names in {dist.import_name}.__all__ that do not exist: {report['missing']}"
    assert report["module_version"] == report["dist_version"] == dist.version
    installed = {canonicalize_name(n): v for n, v in report["installed"].items()}
    ours_installed = set(installed) & set(NAMES)
    assert ours_installed == {name, *siblings}, f"our distributions in the venv: {sorted(ours_installed)}"
    for ours in ours_installed:
        origin = json.loads(next(v for n, v in report["origins"].items() if canonicalize_name(n) == ours))
        assert origin["url"] == wheelhouse[ours].resolve().as_uri(), f"{ours} did not come from this workspace"
    if "torch" in installed:
        assert installed["torch"] == importlib.metadata.version("torch"), "torch is not the local CPU build"
    cuda = sorted(n for n in installed if n.startswith("nvidia-"))
    assert not cuda, f"CUDA wheels were installed: {cuda}"
    assert all(report["scripts"].values()), f"entry points that do not load a callable: {report['scripts']}"
    if name == "deepspeed":
        assert report["dist_version"] == META_VERSION
        assert report["aliases"] == {a: COMPAT_PATHS[a] for a in aliases}

    modules = _wheel_modules(wheelhouse[name], dist.import_name)
    probe = run_probe(str(tmp_path / "venv" / "bin" / "python"), dist.import_name, modules, _TIMEOUT_S)
    failures = failed_imports(dist, probe)
    assert not failures, f"modules of {name} that do not import when it is installed alone:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", NAMES)
def test_wheel_ships_every_source_file(name, built):
    """Nothing under the distribution folder (Python, C++ sources, data) is left out of its wheel.

    Files under src/ must sit at the same path in the wheel; files elsewhere (a csrc/ folder beside src/)
    must be shipped somewhere under the same name (hatch force-include may relocate them).
    """
    wheels, sources = built
    with zipfile.ZipFile(wheels[name]) as zf:
        shipped = set(zf.namelist())
    basenames = {n.rpartition("/")[2] for n in shipped}
    missing = []
    for rel in sources[name]:
        in_src = rel.parts[0] == "src"
        if (rel.relative_to("src").as_posix() not in shipped) if in_src else (rel.name not in basenames):
            missing.append(rel.as_posix())
    assert not missing, f"files of {name} missing from its wheel: {missing}"

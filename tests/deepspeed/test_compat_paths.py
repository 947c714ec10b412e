"""The meta-package's table of documented module paths (``deepspeed._compat_paths.COMPAT_PATHS``).

Every row is imported in one fresh interpreter (so the first ``import deepspeed.x.y`` statement also
installs the hooks) and must yield the provider module itself; the parents the hooks synthesize must
behave like packages that hold only their documented submodules.
"""

from __future__ import annotations

import json
import keyword
import subprocess
import sys
from pathlib import Path

import pytest
from architecture._workspace import by_name, our_import_names

from deepspeed._compat_paths import COMPAT_PATHS, NOT_BUILT

ROWS = sorted(COMPAT_PATHS.items())
KEYS = [key for key, _ in ROWS]
SRC = by_name()["deepspeed"].root / "src"
PREFIXES = sorted({k.rsplit(".", i)[0] for k in KEYS for i in range(1, k.count("."))} - set(KEYS))

_PROBE = r'''
import importlib, importlib.util, json, pkgutil, sys, traceback

rows, prefixes = json.loads(sys.argv[1]), json.loads(sys.argv[2])


def submodules(key, provider, module):
    """For a provider package: does importing key.sub give provider.sub itself, or a second copy?"""
    found = {}
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        if info.name == "__main__":  # runs a CLI when imported; `python -m` is its only use
            continue
        loaded = {}
        for name in (f"{provider}.{info.name}", f"{key}.{info.name}"):
            try:
                loaded[name] = importlib.import_module(name)
            except ImportError:
                loaded[name] = None
        real, via = loaded.values()
        found[info.name] = "same" if via is real else "duplicate" if real is not None and via is not None else (
            "only via alias" if real is None else "alias refuses")
    return found


report = {"rows": {}, "prefixes": {}}
for key, provider in rows:
    entry = report["rows"][key] = {}
    try:
        exec(f"import {key}")
        module = importlib.import_module(provider)
        parent, _, leaf = key.rpartition(".")
        namespace = {}
        exec(f"from {parent} import {leaf} as alias", namespace)
        entry.update(
            same=sys.modules[key] is module and importlib.import_module(key) is module,
            parent_attribute=getattr(sys.modules[parent], leaf, None) is module,
            from_import=namespace["alias"] is module,
            provider_name=module.__name__,
            provider_spec=module.__spec__.name,
            provider_find_spec=importlib.util.find_spec(provider).name,
            submodules=submodules(key, provider, module),
        )
    except Exception:
        entry["error"] = traceback.format_exc()
for prefix in prefixes:
    entry = report["prefixes"][prefix] = {}
    try:
        package = importlib.import_module(prefix)
        entry["is_package"] = hasattr(package, "__path__")
        entry["file"] = getattr(package, "__file__", None)
    except Exception:
        entry["error"] = traceback.format_exc()
    try:
        importlib.import_module(prefix + ".not_a_documented_module")
        entry["undocumented"] = "imported"
    except ImportError as exc:
        entry["undocumented"] = type(exc).__name__
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    """Import every row and every synthesized parent in one fresh interpreter."""
    cwd = tmp_path_factory.mktemp("compat")
    cmd = [sys.executable, "-I", "-c", _PROBE, json.dumps(ROWS), json.dumps(PREFIXES)]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_table_is_well_formed():
    components = set(our_import_names()) - {"deepspeed"}
    assert ROWS, "COMPAT_PATHS is empty"
    for key, provider in ROWS:
        assert key.startswith("deepspeed."), f"{key} is not a deepspeed path"
        for dotted in (key, provider):
            parts = dotted.split(".")
            assert all(p.isidentifier() and not keyword.iskeyword(p) for p in parts), f"bad module path {dotted}"
        assert provider.partition(".")[0] in components, f"{key} -> {provider}: providers are component modules"


@pytest.mark.parametrize("key", KEYS)
def test_row_does_not_shadow_a_real_module(key):
    """A documented path the meta-package implements itself is a real module, not a table row."""
    path = SRC.joinpath(*key.split("."))
    shadowed = [p for p in (path.with_suffix(".py"), path) if p.exists()]
    assert not shadowed, f"{key} is in COMPAT_PATHS and also exists as {[str(p) for p in shadowed]}"


@pytest.mark.parametrize("key", KEYS)
def test_documented_path_is_the_provider_module(key, probe):
    entry = probe["rows"][key]
    assert "error" not in entry, f"import {key} (-> {COMPAT_PATHS[key]}) failed:\n{entry.get('error')}"
    assert entry["same"], f"{key} is not the module object {COMPAT_PATHS[key]}"
    assert entry["parent_attribute"], f"{key.rpartition('.')[0]} does not hold {key} as an attribute"
    assert entry["from_import"], f"from {key.rpartition('.')[0]} import ... gives another object"


@pytest.mark.parametrize("key", KEYS)
def test_provider_keeps_its_own_identity(key, probe):
    """Aliasing must not rename the provider: its __spec__ drives importlib.reload, find_spec and pickling."""
    entry, provider = probe["rows"][key], COMPAT_PATHS[key]
    assert "error" not in entry, entry.get("error")
    assert entry["provider_name"] == provider
    assert entry["provider_spec"] == provider, f"importing {key} replaced {provider}.__spec__"
    assert entry["provider_find_spec"] == provider


def _is_package(module: str) -> bool:
    """Whether a provider is a package, read from the source tree (collection imports nothing)."""
    top, _, rest = module.partition(".")
    dist = by_name().get(our_import_names().get(top, ""))
    return dist is not None and dist.src_dir.joinpath(*rest.split(".") if rest else ()).is_dir()


@pytest.mark.parametrize("key", [k for k in KEYS if _is_package(COMPAT_PATHS[k])])
def test_alias_of_a_package_does_not_duplicate_its_submodules(key, probe):
    """``import <alias>.<sub>`` must give ``<provider>.<sub>`` itself or fail, never load a second copy."""
    entry = probe["rows"][key]
    assert "error" not in entry, entry.get("error")
    bad = {sub: how for sub, how in entry["submodules"].items() if how in {"duplicate", "only via alias"}}
    assert not bad, f"submodules of {COMPAT_PATHS[key]} reached through {key}: {bad}"


@pytest.mark.parametrize("prefix", PREFIXES or [pytest.param(None, marks=pytest.mark.skip("no parents"))])
def test_synthesized_parents_hold_only_documented_modules(prefix, probe):
    entry = probe["prefixes"][prefix]
    assert "error" not in entry, f"import {prefix} failed:\n{entry.get('error')}"
    assert entry["is_package"], f"{prefix} is not a package"
    # under a feature not built yet (deepspeed.inference while only its config is served) the error names it
    not_built = any(prefix == p or prefix.startswith(p + ".") for p in NOT_BUILT)
    expected_error = "FeatureNotAvailable" if not_built else "ModuleNotFoundError"
    assert entry["undocumented"] == expected_error, f"{prefix}.not_a_documented_module: {entry}"
    real = SRC.joinpath(*prefix.split("."), "__init__.py")
    expected = str(real.resolve()) if real.is_file() else None  # a real package wins over a synthesized one
    assert (entry["file"] and str(Path(entry["file"]).resolve())) == expected, f"{prefix} comes from {entry['file']}"


_ATTRIBUTE_PROBE = r'''
import json, sys
import deepspeed

torch_free = "torch" not in sys.modules
found = {
    "lr_schedules": deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES,  # Accelerate reads it after `import deepspeed`
    "engine": deepspeed.runtime.engine.DeepSpeedEngine.__name__,
    "zero": deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.__module__,  # a real module beside the rows
    "ops": deepspeed.ops.adam.DeepSpeedCPUAdam.__module__,
    "launcher": deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME,
    "zero_to_fp32": deepspeed.utils.zero_to_fp32.__name__,
}
missing = {}
for owner, name in [(deepspeed, "not_a_module"), (deepspeed.runtime, "not_a_module"), (deepspeed.ops, "nope")]:
    try:
        getattr(owner, name)
    except AttributeError as exc:
        missing[owner.__name__] = str(exc)
print(json.dumps({"torch_free": torch_free, "found": found, "missing": missing}))
'''


def test_submodules_are_reachable_as_attributes(tmp_path):
    """DeepSpeed's packages import their submodules eagerly, and Accelerate/Transformers rely on it; ours load
    them on first attribute access, so ``import deepspeed`` stays free of torch."""
    proc = subprocess.run([sys.executable, "-I", "-c", _ATTRIBUTE_PROBE], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["torch_free"]
    assert result["found"] == {
        "lr_schedules": ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"],
        "engine": "DeepSpeedEngine", "zero": "deepspeed.runtime.zero.stage_1_and_2", "ops": "ds_ops.adam.cpu_adam",
        "launcher": ".deepspeed_env", "zero_to_fp32": "ds_zero.zero_to_fp32"}
    assert result["missing"] == {
        "deepspeed": "module 'deepspeed' has no attribute 'not_a_module'",
        "deepspeed.runtime": "module 'deepspeed.runtime' has no attribute 'not_a_module'",
        "deepspeed.ops": "module 'deepspeed.ops' has no attribute 'nope'"}


def test_submodule_attributes_are_direct_children_only():
    """A module ``__getattr__`` serves child names only, and says AttributeError for anything else."""
    import deepspeed
    import deepspeed.runtime

    for module, name in [(deepspeed, "no_such.thing"), (deepspeed, ".x"), (deepspeed.runtime, "no_such.thing")]:
        assert not hasattr(module, name)
    assert not hasattr(deepspeed, "runtime.engine")  # not an attribute name


_NOT_BUILT_PROBE = r"""
import importlib, json
import deepspeed
out = {}
for path in ("deepspeed.pipe", "deepspeed.moe.layer", "deepspeed.runtime.pipe.engine", "deepspeed.inference.v2",
             "deepspeed.ops.transformer", "deepspeed.ops.transformer.inference.ds_attention",
             "deepspeed.inference.engine"):
    try:
        importlib.import_module(path)
        out[path] = "imported"
    except ModuleNotFoundError as exc:
        out[path] = [type(exc).__name__, exc.name, str(exc)]
from deepspeed._compat_paths import NOT_BUILT_NAMES
unbuilt = next(iter(NOT_BUILT_NAMES), None)  # a documented top-level name still missing, if any is left
out["hasattr"] = [hasattr(deepspeed, "moe"), hasattr(deepspeed, "init_inference"), hasattr(deepspeed, "zero")]
out["unbuilt"] = [unbuilt, unbuilt is not None and hasattr(deepspeed, unbuilt)]
try:
    getattr(deepspeed, unbuilt or "init_inference")
except AttributeError as exc:
    out["attr"] = str(exc)
import deepspeed.inference.config  # a served path under a not-built parent stays served
out["served"] = deepspeed.inference.config.__name__
print(json.dumps(out))
"""


def test_paths_of_features_not_built_yet_say_so(tmp_path):
    """A documented path of a feature this version lacks is a ModuleNotFoundError naming the feature (so
    ``try: import ... except ImportError`` keeps working), and ``hasattr`` stays False."""
    proc = subprocess.run([sys.executable, "-I", "-c", _NOT_BUILT_PROBE], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["deepspeed.ops.transformer"] == "imported"  # the training layer; its inference kernels are not
    kind, name, message = out["deepspeed.ops.transformer.inference.ds_attention"]
    assert (kind, name) == ("FeatureNotAvailable", "deepspeed.ops.transformer.inference.ds_attention")
    assert "kernel injection" in message and "does not provide yet" in message
    assert out["deepspeed.moe.layer"] == "imported"
    assert out["deepspeed.pipe"] == "imported" and out["deepspeed.runtime.pipe.engine"] == "imported"
    assert "inference" in out["deepspeed.inference.v2"][2]
    assert out["deepspeed.inference.engine"] == "imported"
    assert out["hasattr"] == [True, True, True]
    unbuilt, present = out["unbuilt"]
    if unbuilt is not None:
        assert not present and out["attr"].startswith(f"deepspeed.{unbuilt} is part of ")
    assert out["served"] == "ds_config.inference"

"""DeepSpeed's public surface, walked from ``deepspeed_api_inventory.toml`` so a drop-in gap cannot reopen silently.

Every entry (a module path, or a name below it) is imported and resolved the way scripts reach it (``import a.b``
or attribute access, whichever DeepSpeed offers), its kind checked, and its documented parameters compared with
``inspect.signature``: names and kinds in order (the names of ``*args``/``**kwargs`` are free), defaults equal.
Entries of a feature not built yet are strict xfails (one that starts working must lose its marker) and must fail
with an error naming the feature; ``pending`` entries are non-strict xfails (work in flight).

The README states how many entries are present; ``test_readme_states_the_current_count`` keeps it true. Print the
summary, or rewrite the README line after a change (the test environment: it imports pytest):
``bash scripts/hatch run test:python tests/deepspeed/test_api_inventory.py [--update-readme]``.
"""

from __future__ import annotations

import ast
import builtins
import enum
import functools
import importlib
import inspect
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tomllib

HERE = Path(__file__).resolve().parent
INVENTORY = HERE / "deepspeed_api_inventory.toml"
README = HERE.parents[1] / "README.md"
NO_CHECK = "no signature check"
SIGNED_KINDS = {"class", "exception", "config", "function", "method"}
KINDS = SIGNED_KINDS | {"module", "enum", "property", "constant", "attribute"}
TABLE_KEYS = {"source", "feature", "pending", "note", "names"}
NAME_KEYS = {"name", "kind", "signature", "our_signature", "extra_kwonly", "value", "type", "fields", "members",
             "feature", "pending", "note", "source"}
README_LINE = re.compile(r"DeepSpeed public surface: (\d+) of (\d+) entries present \(`tests/deepspeed/"
                         r"deepspeed_api_inventory\.toml`; (\d+) more belong to features not built yet\)")
_ANY = object()  # a default written as ``...``: its presence is checked, not its value


@dataclass(frozen=True)
class Entry:
    module: str
    name: str  # "" for the module itself
    kind: str
    data: dict[str, Any] = field(hash=False, compare=False)
    feature: str | None = None
    pending: str | None = None

    @property
    def id(self) -> str:
        return f"{self.module}:{self.name}" if self.name else self.module

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


def load_inventory(path: Path = INVENTORY) -> list[Entry]:
    entries = []
    for module, table in tomllib.loads(path.read_text()).items():
        feature, pending = table.get("feature"), table.get("pending")
        entries.append(Entry(module, "", "module", table, feature, pending))
        for row in table.get("names", []):
            entries.append(Entry(module, row.get("name", ""), row.get("kind", ""), row, row.get("feature", feature),
                                 row.get("pending", pending)))
    return entries


ENTRIES = load_inventory()


# ---------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------
def resolve(path: str) -> Any:
    """``a.b.c`` as a script reaches it: an attribute where the parent has one, else ``import a.b.c``."""
    parts = path.split(".")
    obj, done = importlib.import_module(parts[0]), parts[0]
    for part in parts[1:]:
        done = f"{done}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError as missing:
            if not inspect.ismodule(obj):
                raise
            try:
                obj = importlib.import_module(done)  # a FeatureNotAvailable here names the feature
            except ModuleNotFoundError as exc:
                if type(exc) is ModuleNotFoundError and exc.name == done:
                    raise missing from None  # no such module either: the AttributeError says more
                raise
    return obj


def _expected(text: str) -> list[tuple[str, Any, Any]]:
    args = ast.parse(f"def _({text}): pass").body[0].args  # type: ignore[attr-defined]
    positional = [(a, inspect.Parameter.POSITIONAL_ONLY) for a in args.posonlyargs]
    positional += [(a, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [(a.arg, kind, d) for (a, kind), d in zip(positional, defaults, strict=True)]
    if args.vararg:
        out.append(("*" + args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None))
    out += [(a.arg, inspect.Parameter.KEYWORD_ONLY, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        out.append(("**" + args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None))
    return [(name, kind, _default(node)) for name, kind, node in out]


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return inspect.Parameter.empty
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return _ANY
    namespace = {"sys": sys}
    if "torch" in ast.unparse(node):
        namespace["torch"] = importlib.import_module("torch")
    return eval(compile(ast.Expression(node), "<inventory>", "eval"), namespace)  # noqa: S307 - our own file


def _same(actual: Any, expected: Any) -> bool:
    if expected is _ANY:
        return actual is not inspect.Parameter.empty
    if isinstance(actual, enum.Enum) and not isinstance(expected, enum.Enum):
        return expected in (actual.value, actual.name)
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(_same(a, e) for a, e in zip(actual, expected, strict=True))
    try:
        equal = bool(actual == expected)
    except Exception:  # noqa: BLE001 - an object whose == does not give a bool is simply not equal
        return False
    return equal and isinstance(actual, bool) == isinstance(expected, bool)  # False == 0, yet not the same default


def _render(params: list[tuple[str, Any, Any]]) -> str:
    out = []
    for name, kind, default in params:
        if kind is inspect.Parameter.KEYWORD_ONLY and not any(o.startswith("*") for o in out):
            out.append("*")
        shown = "..." if default is _ANY else repr(default)
        out.append(name if default is inspect.Parameter.empty else f"{name}={shown}")
    return ", ".join(out)


def _actual_signature(entry: Entry, obj: Any) -> list[tuple[str, Any, Any]]:
    drop_self = False
    if entry.kind == "method":
        owner_path, _, attr = entry.path.rpartition(".")
        raw = inspect.getattr_static(resolve(owner_path), attr)
        if isinstance(raw, staticmethod):
            obj = raw.__func__
        elif inspect.isfunction(raw):
            obj, drop_self = raw, True
    params = list(inspect.signature(obj).parameters.values())
    if drop_self and params and params[0].kind is not inspect.Parameter.VAR_POSITIONAL:
        params = params[1:]
    marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [(marks.get(p.kind, "") + p.name, p.kind, p.default) for p in params]


def _check_signature(entry: Entry, obj: Any) -> None:
    text = entry.data.get("our_signature", entry.data.get("signature", NO_CHECK))
    if text == NO_CHECK:
        return
    expected, actual = _expected(text), _actual_signature(entry, obj)
    whose = "the inventory's our_signature" if "our_signature" in entry.data else "DeepSpeed's"
    where = f"{entry.path}({_render(actual)}) differs from {whose} ({_render(expected)})"
    for i, (name, kind, default) in enumerate(expected):
        assert i < len(actual), f"{where}: {name} is missing"
        a_name, a_kind, a_default = actual[i]
        assert a_kind is kind, f"{where}: parameter {i + 1} is {a_name} ({a_kind.description}), not {name} " \
                               f"({kind.description})"
        if not name.startswith("*"):
            assert a_name == name, f"{where}: parameter {i + 1} is {a_name}, not {name}"
        if default is inspect.Parameter.empty:
            assert a_default is inspect.Parameter.empty, f"{where}: {name} has a default; DeepSpeed's is required"
        else:
            assert a_default is not inspect.Parameter.empty, f"{where}: {name} has no default"
            assert _same(a_default, default), f"{where}: {name} defaults to {a_default!r}, not {default!r}"
    extra = actual[len(expected):]
    allowed = entry.data.get("extra_kwonly", False) and all(k is inspect.Parameter.KEYWORD_ONLY for _, k, _ in extra)
    assert not extra or allowed, f"{where}: extra parameters {[n for n, _, _ in extra]}"


def check(entry: Entry) -> None:
    """Raise (AssertionError, ImportError, AttributeError, ...) unless the entry is present as documented."""
    obj = resolve(entry.path)
    kind = entry.kind
    if kind == "module":
        assert inspect.ismodule(obj), f"{entry.path} is {type(obj).__name__}, not a module"
    elif kind in {"class", "exception", "config", "enum"}:
        assert inspect.isclass(obj), f"{entry.path} is {type(obj).__name__}, not a class"
        if kind == "exception":
            assert issubclass(obj, BaseException), f"{entry.path} is not an exception class"
        if kind == "config":
            fields = getattr(obj, "model_fields", None)
            assert fields is not None, f"{entry.path} is not a pydantic model"
            missing = [f for f in entry.data.get("fields", []) if f not in fields]
            assert not missing, f"{entry.path} lacks the documented fields {missing}"
        if kind == "enum":
            assert issubclass(obj, enum.Enum), f"{entry.path} is not an Enum"
            missing = [m for m in entry.data.get("members", []) if m not in obj.__members__]
            assert not missing, f"{entry.path} lacks the documented members {missing}"
    elif kind in {"function", "method"}:
        assert callable(obj) and not inspect.isclass(obj), f"{entry.path} is {type(obj).__name__}, not a {kind}"
    elif kind == "property":
        owner_path, _, attr = entry.path.rpartition(".")
        raw = inspect.getattr_static(resolve(owner_path), attr)
        assert isinstance(raw, (property, functools.cached_property)), f"{entry.path} is not a property"
    if "value" in entry.data:
        expected = _default(ast.parse(entry.data["value"], mode="eval").body)
        assert _same(obj, expected), f"{entry.path} is {obj!r}, not {expected!r}"
    if "type" in entry.data:
        assert isinstance(obj, getattr(builtins, entry.data["type"])), \
            f"{entry.path} is a {type(obj).__name__}, not a {entry.data['type']}"
    if kind in SIGNED_KINDS:
        _check_signature(entry, obj)


def problem(entry: Entry) -> str | None:
    try:
        check(entry)
    except Exception as exc:  # noqa: BLE001 - any failure means "not present as documented"
        return f"{type(exc).__name__}: {exc}"
    return None


def summary(entries: list[Entry] = ENTRIES) -> dict[str, list[Entry]]:
    out: dict[str, list[Entry]] = {"present": [], "feature": [], "pending": [], "missing": [], "now_present": []}
    for entry in entries:
        ok = problem(entry) is None
        label = "present" if ok else "feature" if entry.feature else "pending" if entry.pending else "missing"
        out[label].append(entry)
        if ok and entry.pending and not entry.feature:
            out["now_present"].append(entry)
    return out


def readme_line(counts: dict[str, list[Entry]], total: int) -> str:
    return (f"DeepSpeed public surface: {len(counts['present'])} of {total} entries present "
            f"(`tests/deepspeed/deepspeed_api_inventory.toml`; {len(counts['feature'])} more belong to features "
            f"not built yet)")


# ---------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------
def _marked(entry: Entry) -> Any:
    if entry.feature:
        return pytest.param(entry, id=entry.id, marks=pytest.mark.xfail(reason=entry.feature, strict=True))
    if entry.pending:
        return pytest.param(entry, id=entry.id, marks=pytest.mark.xfail(reason=entry.pending, strict=False))
    return pytest.param(entry, id=entry.id)


def test_inventory_is_well_formed():
    from deepspeed._compat_paths import NOT_BUILT, NOT_BUILT_NAMES

    features = set(NOT_BUILT.values()) | set(NOT_BUILT_NAMES.values())
    tables = tomllib.loads(INVENTORY.read_text())
    for module, table in tables.items():
        assert module.startswith("deepspeed") and all(p.isidentifier() for p in module.split(".")), module
        assert set(table) <= TABLE_KEYS, f"{module}: unknown keys {set(table) - TABLE_KEYS}"
        for row in table.get("names", []):
            assert set(row) <= NAME_KEYS, f"{module}:{row.get('name')}: unknown keys {set(row) - NAME_KEYS}"
    seen = set()
    for entry in ENTRIES:
        assert entry.id not in seen, f"{entry.id} is listed twice"
        seen.add(entry.id)
        assert entry.kind in KINDS, f"{entry.id}: kind {entry.kind!r} is not one of {sorted(KINDS)}"
        assert not entry.feature or entry.feature in features, \
            f"{entry.id}: feature {entry.feature!r} is not a NOT_BUILT / NOT_BUILT_NAMES text of _compat_paths.py"
        if entry.name:
            assert all(p.isidentifier() for p in entry.name.split(".")), entry.id
        if entry.kind in SIGNED_KINDS:
            assert "signature" in entry.data, f"{entry.id}: give a signature or {NO_CHECK!r}"
            for key in ("signature", "our_signature"):
                if entry.data.get(key, NO_CHECK) != NO_CHECK:
                    _expected(entry.data[key])  # parses, and its defaults evaluate
            assert "our_signature" not in entry.data or entry.data.get("note"), \
                f"{entry.id}: our_signature needs a note saying why we differ"
        else:
            assert "signature" not in entry.data, f"{entry.id}: a {entry.kind} has no signature"


# dotted names in the spec text that are not API paths
_NOT_API = {
    "deepspeed.ai": "the website's host name",
    "deepspeed.config": "a garbled index line (OffloadOptimizerConfig 'in module deepspeed.config')",
    "deepspeed.inference.HFBertLayerPolicy": "a stale docstring example; DeepSpeed has it in deepspeed.module_inject",
    "deepspeed.inference.config.DeepSpeedInferenceConfigset_empty_params": "a garbled index line",
    "deepspeed.inference.config.DeepSpeedInferenceConfigstage": "a garbled index line",
    "deepspeed.runtime.zero.config.DeepSpeedZero": "an index line cut at a page break",
    "deepspeed.runtime.zero.config.DeepSpeedZeroOffloadParameters": "a garbled index line (...OffloadParamConfig)",
}


def test_inventory_covers_every_path_the_spec_names():
    """Every dotted ``deepspeed.*`` path of the API reference is an entry (so a spec update shows up here)."""
    from _spec_docs import require_spec

    text = (require_spec("api-reference.txt") / "api-reference.txt").read_text()
    named = {m.rstrip(".") for m in re.findall(r"deepspeed\.[A-Za-z_][\w.]*", text)}
    listed = {e.path for e in ENTRIES}
    assert not (missing := sorted(named - listed - set(_NOT_API))), f"spec paths missing from the inventory: {missing}"


@pytest.mark.parametrize("entry", [_marked(e) for e in ENTRIES])
def test_entry_is_present_as_documented(entry: Entry):
    check(entry)


@pytest.mark.parametrize("entry", [
    pytest.param(e, id=e.id, marks=[pytest.mark.xfail(reason=e.pending, strict=False)] if e.pending else [])
    for e in ENTRIES if e.feature])
def test_not_built_entry_names_its_feature(entry: Entry):
    """A path of a feature not built yet fails with an error naming the feature, never a bare ``No module named``."""
    try:
        resolve(entry.path)
    except (ImportError, AttributeError) as exc:
        assert entry.feature in str(exc), f"{entry.path} fails without naming {entry.feature!r}: {exc}"
    else:
        pytest.skip("resolves (its signature is not DeepSpeed's yet; test_entry_is_present_as_documented covers it)")


def test_readme_states_the_current_count():
    counts = summary()
    line = readme_line(counts, len(ENTRIES))
    print(f"\n{line}\npending: {[e.id for e in counts['pending']]}\n"
          f"pending markers to remove (now present): {[e.id for e in counts['now_present']]}")
    found = README_LINE.search(README.read_text())
    assert found, f"README.md lacks the line {line!r}"
    assert found.group(0) == line, (f"README.md says {found.group(0)!r}; the inventory's state is {line!r} "
                                    "(bash scripts/hatch run test:python tests/deepspeed/test_api_inventory.py "
                                    "--update-readme)")


def main(argv: list[str]) -> int:
    counts = summary()
    for label in ("feature", "pending", "missing"):
        for entry in counts[label]:
            print(f"{label:8} {entry.id}: {problem(entry)}")
    for entry in counts["now_present"]:
        print(f"present  {entry.id}: remove its pending marker")
    line = readme_line(counts, len(ENTRIES))
    print(f"{line}; {len(counts['pending'])} pending, {len(counts['missing'])} missing")
    if "--update-readme" in argv:
        text = README.read_text()
        if not README_LINE.search(text):
            print("README.md has no such line to update", file=sys.stderr)
            return 1
        README.write_text(README_LINE.sub(line, text, count=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

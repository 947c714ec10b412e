"""Ship test bodies and their arguments to worker processes.

Plain pickle sends a function as "module.qualname", which breaks for the functions tests actually write:
pytest imports test files under names a fresh interpreter cannot import (``--import-mode=importlib``),
nested functions and lambdas have no importable name, and a decorated test is a different object than the
body it wraps. This pickler handles them:

* a function or class whose module is a pytest test file, a script's ``__main__`` or otherwise not
  importable by name is sent as (module file, qualname); the worker loads the file once (with pytest's
  assertion rewriting when the parent's copy had it, so failed ``assert`` s show their values);
* a function reached through ``__wrapped__`` (``functools.wraps``) is sent as its wrapper plus the depth;
* a nested function, closure or lambda is sent by value: marshalled code (parent and worker run the same
  interpreter), its module's globals by reference, defaults and closure cells pickled recursively (cells
  are filled after the function is memoised, so self-referencing closures work).

Everything else goes through standard pickle.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import io
import marshal
import os
import pickle
import sys
import types
from typing import Any

_MAX_WRAP_DEPTH = 8
_BY_NAME_CACHE: dict[tuple[str, str | None], bool] = {}
_FILE_MODULES: dict[tuple[str, str], types.ModuleType] = {}


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` so that a worker process running :func:`loads` can rebuild it."""
    buf = io.BytesIO()
    _BodyPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    """Inverse of :func:`dumps` (runs in the worker)."""
    return pickle.loads(data)


class _BodyPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType):
            return _reduce_function(obj)
        if isinstance(obj, type) and _needs_file(obj.__module__):
            return _reduce_class(obj)
        return NotImplemented


def _importable_by_name(modname: str, file: str | None) -> bool:
    """True when ``import modname`` in a process with our sys.path finds the same file."""
    key = (modname, file)
    if key not in _BY_NAME_CACHE:
        _BY_NAME_CACHE[key] = _search_sys_path(modname, file)
    return _BY_NAME_CACHE[key]


def _search_sys_path(modname: str, file: str | None) -> bool:
    if file is None:
        return True  # built-in or namespace module: import by name is the only way anyway
    target = os.path.realpath(file)
    folder, stem = os.path.dirname(target), os.path.basename(target).split(".")[0]
    parts = modname.split(".")
    for entry in sys.path:
        base = os.path.join(os.path.realpath(entry or os.getcwd()), *parts)
        if (stem == "__init__" and folder == base) or (stem == parts[-1] and folder == os.path.dirname(base)):
            return True
    return _found_by_import_system(modname, target)


def _found_by_import_system(modname: str, target: str) -> bool:
    """Fallback for import hooks (e.g. some editable installs): ask the import system, but only when the
    parent package is already imported, so that asking has no side effects."""
    parent = modname.rpartition(".")[0]
    if parent and parent not in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec(modname)
    except (ImportError, ValueError, AttributeError):
        return False
    origin = getattr(spec, "origin", None)
    return bool(origin) and os.path.realpath(origin) == target


def _needs_file(modname: str | None) -> bool:
    mod = sys.modules.get(modname or "")
    if mod is None:
        return False
    if modname == "__main__" or "@pytest_ar" in vars(mod):
        return True
    return not _importable_by_name(modname, getattr(mod, "__file__", None))


def _locator(modname: str | None) -> tuple:
    """How the worker finds module ``modname``: ("name", name) or ("file", name, path, rewrite_asserts)."""
    mod = sys.modules.get(modname or "")
    if mod is None:
        raise pickle.PicklingError(f"module {modname!r} is not loaded; cannot send its functions to the ranks")
    if not _needs_file(modname):
        return ("name", modname)
    file = getattr(mod, "__file__", None)
    if not file:
        raise pickle.PicklingError(
            f"module {modname!r} has no source file; define the distributed test body in a .py file"
        )
    return ("file", modname, os.path.abspath(file), "@pytest_ar" in vars(mod))


def _resolve_depth(mod: types.ModuleType, qualname: str, target: Any) -> int | None:
    """Number of ``__wrapped__`` hops from ``mod.<qualname>`` to ``target``; None if unreachable."""
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    for depth in range(_MAX_WRAP_DEPTH):
        if obj is target:
            return depth
        obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            return None
    return None


def _reduce_class(cls: type) -> tuple:
    mod = sys.modules[cls.__module__]
    if _resolve_depth(mod, cls.__qualname__, cls) != 0:
        raise pickle.PicklingError(
            f"class {cls.__qualname__} of {cls.__module__} is not reachable by name; define it at module level"
        )
    return (_load_attr, (_locator(cls.__module__), cls.__qualname__, 0))


def _reduce_function(fn: types.FunctionType) -> Any:
    mod = sys.modules.get(fn.__module__ or "")
    if mod is not None:
        depth = _resolve_depth(mod, fn.__qualname__, fn)
        if depth == 0 and not _needs_file(fn.__module__):
            return NotImplemented  # plain pickle by name (this also covers this module's own helpers)
        if depth is not None:
            return (_load_attr, (_locator(fn.__module__), fn.__qualname__, depth))
    # By value: its globals are its defining module's namespace, which may differ from __module__
    # (functools.wraps copies __module__ but not __globals__).
    home = fn.__globals__.get("__name__")
    cells = fn.__closure__ or ()
    args = (marshal.dumps(fn.__code__), _locator(home), fn.__name__, fn.__qualname__, len(cells))
    state = (fn.__defaults__, fn.__kwdefaults__, tuple(_cell_state(c) for c in cells), dict(fn.__dict__))
    return (_make_function, args, state, None, None, _set_function_state)


def _cell_state(cell: types.CellType) -> tuple[bool, Any]:
    try:
        return (True, cell.cell_contents)
    except ValueError:  # a free variable not bound yet
        return (False, None)


# ----------------------------------------------------------------------------- worker side


def _make_function(code: bytes, locator: tuple, name: str, qualname: str, ncells: int) -> types.FunctionType:
    cells = tuple(types.CellType() for _ in range(ncells)) if ncells else None
    fn = types.FunctionType(marshal.loads(code), load_module(locator).__dict__, name, None, cells)
    fn.__qualname__ = qualname
    return fn


def _set_function_state(fn: types.FunctionType, state: tuple) -> None:
    defaults, kwdefaults, cell_states, attrs = state
    fn.__defaults__ = defaults
    fn.__kwdefaults__ = kwdefaults
    for cell, (bound, value) in zip(fn.__closure__ or (), cell_states, strict=True):
        if bound:
            cell.cell_contents = value
    fn.__dict__.update(attrs)


def _load_attr(locator: tuple, qualname: str, depth: int) -> Any:
    obj: Any = load_module(locator)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    for _ in range(depth):
        obj = obj.__wrapped__
    return obj


def load_module(locator: tuple) -> types.ModuleType:
    """Import the module a :func:`_locator` tuple describes (cached per process)."""
    if locator[0] == "name":
        return importlib.import_module(locator[1])
    _, modname, path, rewrite = locator
    # A script's __main__ is loaded under multiprocessing's alias so its `if __name__ == "__main__"` block
    # does not run in the worker.
    name = "__mp_main__" if modname == "__main__" else modname
    key = (name, path)
    if key in _FILE_MODULES:
        return _FILE_MODULES[key]
    existing = sys.modules.get(name)
    if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == path:
        _FILE_MODULES[key] = existing
        return existing
    module = _exec_file(name, path, rewrite)
    _FILE_MODULES[key] = module
    return module


def _exec_file(name: str, path: str, rewrite: bool) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load test module {name!r} from {path}")
    module = importlib.util.module_from_spec(spec)
    _ensure_parents(name)
    sys.modules[name] = module
    try:
        if rewrite:
            _exec_rewritten(module, path)
        else:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _exec_rewritten(module: types.ModuleType, path: str) -> None:
    """Run the file with pytest's assertion rewriting, as pytest did in the parent."""
    from _pytest.assertion import rewrite as pytest_rewrite

    with open(path, "rb") as fh:
        source = fh.read()
    tree = ast.parse(source, filename=path)
    pytest_rewrite.rewrite_asserts(tree, source, path, None)
    # Code shipped by value from the parent was rewritten there and needs these names even if the
    # module's own code changes; setting them up front keeps both consistent.
    module.__dict__.setdefault("@py_builtins", builtins)
    module.__dict__.setdefault("@pytest_ar", pytest_rewrite)
    exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)


def _ensure_parents(name: str) -> None:
    """Make ``a`` and ``a.b`` importable for ``a.b.c`` so pickle can name objects defined in it."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if prefix in sys.modules:
            continue
        try:
            importlib.import_module(prefix)
        except ImportError:
            placeholder = types.ModuleType(prefix)
            placeholder.__path__ = []
            sys.modules[prefix] = placeholder

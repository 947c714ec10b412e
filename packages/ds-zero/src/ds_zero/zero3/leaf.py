"""ZeRO-3 leaf modules: a module whose whole subtree is gathered at once, as one unit, instead of submodule by
submodule (MoE blocks whose experts run in a data-dependent order, or many tiny submodules)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_ATTR = "_z3_leaf"


def _matches(module: torch.nn.Module, classes: tuple) -> bool:
    for cls in classes:
        if isinstance(cls, type) and isinstance(module, cls):
            return True
        if isinstance(cls, str):
            kind = type(module)
            if cls in (kind.__name__, f"{kind.__module__}.{kind.__qualname__}"):
                return True
    return False


def _set(model: torch.nn.Module, leaf_module_classes: Any, flag: bool, raise_if_not_found: bool) -> list:
    classes = tuple(leaf_module_classes) if isinstance(leaf_module_classes, (list, tuple, set)) \
        else (leaf_module_classes,)
    found = []
    for module in model.modules():
        if _matches(module, classes):
            module.__dict__[_ATTR] = flag
            found.append(module)
    if not found and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"no module of the classes {names} was found in {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Any,
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark every module of ``leaf_module_classes`` (classes or class names) in ``model`` as a ZeRO-3 leaf."""
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def _set_by(model: torch.nn.Module, wanted: Any, match: Any, flag: bool, raise_if_not_found: bool,
            what: str) -> tuple[list[torch.nn.Module], list[str]]:
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    found, hit = [], set()
    for name, module in model.named_modules():
        for w in wanted:
            if match(name, w):
                module.__dict__[_ATTR] = flag
                found.append(module)
                hit.add(w)
    missing = [w for w in wanted if w not in hit]
    if missing and raise_if_not_found:
        raise ValueError(f"no module of {type(model).__name__} has the {what} {missing}")
    return found, missing


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Any, flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark (``flag``) the modules named exactly ``module_names`` (``named_modules()`` names); returns the modules
    and the names that matched nothing."""
    return _set_by(model, module_names, lambda name, w: name == w, flag, raise_if_not_found, "names")


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Any, flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark (``flag``) the modules whose ``named_modules()`` name ends with one of ``module_name_suffixes``."""
    return _set_by(model, module_name_suffixes, lambda name, w: bool(name) and name.endswith(w), flag,
                   raise_if_not_found, "name suffixes")


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Any,
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    return _set(model, leaf_module_classes, False, raise_if_not_found)


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return bool(getattr(model, _ATTR, False))


def z3_leaf_parameter(param: Any) -> bool:
    return bool(getattr(param, "ds_z3_leaf_module", False))


def apply_leaf_config(model: torch.nn.Module, classes: Iterable[str] = (), names: Iterable[str] = (),
                      name_suffixes: Iterable[str] = ()) -> list[torch.nn.Module]:
    """Mark the modules the config's ``leaf_module`` block names (classes, ``named_modules()`` names, name
    suffixes) as leaves, as DeepSpeed's engine does: afterwards ``z3_leaf_module`` is true for them. Entries
    that match nothing are skipped (the defaults name Hugging Face classes a model may not have)."""
    found = _set(model, tuple(classes), True, raise_if_not_found=False) if classes else []
    if names:
        found += set_z3_leaf_modules_by_name(model, names, raise_if_not_found=False)[0]
    if name_suffixes:
        found += set_z3_leaf_modules_by_suffix(model, name_suffixes, raise_if_not_found=False)[0]
    return list({id(m): m for m in found}.values())


def leaf_rule(classes: Iterable[str] = (), names: Iterable[str] = (), name_suffixes: Iterable[str] = ()) -> Any:
    """The config's ``leaf_module`` block as a predicate ``(qualified name, module) -> bool``: marked modules,
    modules of the listed classes (bare or dotted names), listed ``named_modules()`` names, and names that end
    with a listed suffix."""
    classes, exact, suffixes = tuple(classes), set(names), tuple(name_suffixes)

    def is_leaf(name: str, module: torch.nn.Module) -> bool:
        if z3_leaf_module(module) or _matches(module, classes):
            return True
        return bool(name) and (name in exact or name.endswith(suffixes))
    return is_leaf

"""ZeRO-3 leaf modules: a module whose whole subtree is gathered at once, as one unit, instead of submodule by
submodule (MoE blocks whose experts run in a data-dependent order, or many tiny submodules)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

import torch

from ds_zero.zero3.param import is_partitioned

logger = logging.getLogger("DeepSpeed")

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
    """Does ``param`` belong to a ZeRO-3 leaf module (``param.ds_z3_leaf_module``, set when the hooks go on)?"""
    return getattr(param, "ds_z3_leaf_module", None) is not None


def leaf_parameters(params: Iterable[torch.nn.Parameter]) -> dict[torch.nn.Module, list[torch.nn.Parameter]]:
    """``params`` of leaf modules by their leaf module, in order (DeepSpeed's ``optimizer.leaf_parameters``)."""
    found: dict[torch.nn.Module, list[torch.nn.Parameter]] = {}
    for p in params:
        if z3_leaf_parameter(p):
            found.setdefault(p.ds_z3_leaf_module, []).append(p)
    return found


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


_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList,
               torch.nn.ParameterDict)
_MAX_LEAF_NUMEL = 10 ** 9  # a bigger subtree gathered whole would cost more memory than its hooks save


def _numel(params: Iterable[torch.nn.Parameter]) -> int:
    return sum(p.ds_numel if is_partitioned(p) else p.numel() for p in params)


def _granularity(module: torch.nn.Module, found: list[int]) -> tuple[int, int]:
    """``(layers, elements)`` of ``module``'s subtree, DeepSpeed's way: every parameterless module counts for
    nothing, a childless one with parameters is one layer, any other one adds itself as a layer unless it is a
    plain container (``Sequential``, ``ModuleList``, ...: its children's hooks must stay). Sets
    ``module.ds_model_granularity`` (elements per layer; ``sys.maxsize``: never a leaf) and appends it to
    ``found`` when it is a candidate."""
    if next(module.parameters(), None) is None:
        module.ds_model_granularity = sys.maxsize
        return 0, 0
    numel = _numel(module.parameters(recurse=False))
    children = list(module.children())
    if not children:
        module.ds_model_granularity = sys.maxsize
        return 1, numel
    layers = 0
    for child in children:
        child_layers, child_numel = _granularity(child, found)
        layers += child_layers
        numel += child_numel
    if type(module) in _CONTAINERS:
        module.ds_model_granularity = sys.maxsize
        return layers, numel
    layers += 1
    module.ds_model_granularity = numel // layers if numel <= _MAX_LEAF_NUMEL else sys.maxsize
    found.append(module.ds_model_granularity)
    return layers, numel


def _mark_granularity_leaves(module: torch.nn.Module, threshold: int) -> None:
    """Outermost first: a module of at most ``threshold`` elements per layer becomes a leaf (its subtree is
    gathered at once) and its descendants are not looked at."""
    if next(module.parameters(), None) is None:
        return
    if module.ds_model_granularity <= threshold:
        module.__dict__[_ATTR] = True
        return
    for child in module.children():
        _mark_granularity_leaves(child, threshold)


def apply_granularity_threshold(root: torch.nn.Module, threshold: int) -> None:
    """``stage3_module_granularity_threshold``: mark as ZeRO-3 leaves (``z3_leaf_module`` is true for them
    afterwards, the model itself included) the modules fine enough that one gather for the subtree beats a hook
    per submodule; warns with the smallest granularity when the threshold is too small to mark any."""
    if threshold <= 0:
        return
    found: list[int] = []
    _granularity(root, found)
    if found and min(found) <= threshold:
        _mark_granularity_leaves(root, threshold)
    else:
        smallest = min(found) if found else None
        logger.warning(f"stage3_module_granularity_threshold={threshold} marks no module as a ZeRO-3 leaf: the "
                       f"finest module has {smallest} elements per layer; set the threshold at least that high")

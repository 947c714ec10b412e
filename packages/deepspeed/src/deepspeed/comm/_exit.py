"""Process groups end before the interpreter does, so a rank that finished its work exits 0.

Why: a gloo process group runs worker threads (``pt_gloo_runloop``) that run each collective and then drop it.
Dropping it can release Python objects: a tensor whose Python object outlived the call (a temporary passed to
an ``all_reduce``), or the ``contextvars`` context that autograd keeps in thread-local state during
``backward`` (every collective issued from a gradient hook captures it). Releasing one takes the GIL. A worker
that asks for the GIL once the interpreter is finalising is ended by CPython with ``pthread_exit``, whose
unwinding through the work's ``noexcept`` destructor calls ``std::terminate``: "terminate called without an
active exception", SIGABRT, after the job's work is done (seen in a core dump: ``runLoop`` ->
``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` -> ``SafePyObject`` decref -> ``take_gil`` -> ``pthread_exit``).

The threads stop only when the group's C++ object is destroyed (gloo's ``shutdown``/``abort`` do nothing),
which joins them with the GIL released; torch's ``destroy_process_group`` only forgets the group. Any Python
reference left (an engine, an MoE layer's ``ep_group``, a pipeline grid, a table of groups, a closure, a
default argument) keeps it, and its threads, alive into finalisation. So at exit :func:`end_process_groups`
destroys what is still registered, collects garbage (an engine made inside a function sits in reference
cycles), and, if gloo threads are still running, replaces every remaining reference to a destroyed group with
``None`` (a destroyed group cannot be used anyway), which destroys it and joins its threads while Python still
runs. Registered once, when ``deepspeed.comm`` is imported; a no-op when no group was made or the user
destroyed everything already.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import types
import warnings
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
_GLOO_WORKER = "pt_gloo_runloop"  # the name gloo gives its worker threads (Linux: /proc/self/task/*/comm)
_registered = False


def gloo_workers() -> int | None:
    """How many gloo worker threads this process runs; None where threads cannot be listed (not Linux)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as handle:
                count += handle.read().strip() == _GLOO_WORKER
        except OSError:  # the thread ended meanwhile
            continue
    return count


_GROUP_TYPES = (dist.ProcessGroup, torch._C._distributed_c10d.Backend) if dist.is_available() else ()


def _is_group(value: Any) -> bool:
    """A process group, or one of its backends (``pg._get_backend(device)``), which holds the threads."""
    return isinstance(value, _GROUP_TYPES)


def _untracked_dict(value: Any) -> bool:
    # a dict whose values are all untracked objects (process groups are) is itself untracked by the collector,
    # so gc.get_objects() does not list it: it is reached through its (tracked) holder instead
    return isinstance(value, dict) and not gc.is_tracked(value)


def _drop_in_mapping(mapping: dict) -> int:
    dropped = 0
    for key, value in list(mapping.items()):
        if _is_group(value):
            mapping[key] = None
            dropped += 1
        elif _untracked_dict(value):
            dropped += _drop_in_mapping(value)
    return dropped


def _drop_in_list(items: list) -> int:
    dropped = 0
    for index, value in enumerate(items):
        if _is_group(value):
            items[index] = None
            dropped += 1
        elif _untracked_dict(value):
            dropped += _drop_in_mapping(value)
    return dropped


def _drop_in_function(fn: types.FunctionType) -> int:
    dropped = 0
    defaults = fn.__defaults__
    if defaults and any(_is_group(value) for value in defaults):
        fn.__defaults__ = tuple(None if _is_group(value) else value for value in defaults)
        dropped += 1
    if fn.__kwdefaults__:
        dropped += _drop_in_mapping(fn.__kwdefaults__)
    return dropped


def _drop_in_attributes(obj: Any) -> int:
    # instance attributes live in an inline array (3.11+) until __dict__ is asked for: ask only where the
    # collector's view of the object shows a group (asking everywhere would build a dict per object)
    if isinstance(obj, (type, types.ModuleType)) or \
            not any(_is_group(ref) or _untracked_dict(ref) for ref in gc.get_referents(obj)):
        return 0
    try:
        attributes = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):  # a group held in __slots__ or by a C object: out of reach
        return 0
    return _drop_in_mapping(attributes) if isinstance(attributes, dict) else 0


def _drop_in(obj: Any) -> int:
    """Replace references to process groups held directly by ``obj`` with None; returns how many."""
    if isinstance(obj, dict):
        return _drop_in_mapping(obj)
    if isinstance(obj, list):
        return _drop_in_list(obj)
    if isinstance(obj, set):
        found = [value for value in obj if _is_group(value)]
        obj.difference_update(found)
        return len(found)
    if isinstance(obj, types.CellType):
        try:
            if _is_group(obj.cell_contents):
                obj.cell_contents = None
                return 1
        except ValueError:  # an empty cell
            pass
        return 0
    if isinstance(obj, types.FunctionType):
        return _drop_in_function(obj)
    return _drop_in_attributes(obj)


def drop_group_references() -> int:
    """Replace every reference to a process group reachable from a garbage-collected container, cell,
    function default or instance attribute with None; returns how many were replaced."""
    with warnings.catch_warnings():  # isinstance() on deprecated module proxies (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")  # warns once per check: a screenful at every exit
        return sum(_drop_in(obj) for obj in gc.get_objects())


def end_process_groups() -> None:
    """Destroy every process group and make sure its gloo threads are joined (see the module docstring)."""
    if not dist.is_available():
        return
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - a broken backend must not stop the threads being joined
            logger.warning(f"destroying the process groups at exit failed ({type(exc).__name__}: {exc})")
    if gloo_workers() == 0:
        return
    gc.collect()
    if gloo_workers() == 0:
        return
    drop_group_references()
    gc.collect()


def register_exit_hook() -> None:
    """Run :func:`end_process_groups` at interpreter exit; once per process, however often it is called."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(end_process_groups)

"""Reading and writing checkpoint files: ``torch.save`` through the atomic writer, safe ``torch.load``.

Loading uses ``weights_only=True``: our own content (tensors, dicts, lists, numbers, strings, ``torch.Size``)
needs no allowlist. A file holding other objects (e.g. an ``argparse.Namespace`` in the client state) fails
with an error naming them; allow them with ``torch.serialization.add_safe_globals`` or load a file you
trust with ``EngineState(trusted_load=True)``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.checkpointing._atomic import atomic_write
from deepspeed.runtime.checkpointing._errors import CorruptCheckpointError, UnsafeCheckpointError

_WEIGHTS_ONLY_MARK = "Weights only load failed"


def save_file(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically (temporary name, fsync, rename, fsync the directory)."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


def _needs_clone(tensor: torch.Tensor) -> bool:
    """Off the CPU, or a view into a larger storage (``torch.save`` would write the whole storage)."""
    return tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()


def compact_for_save(item: Any) -> Any:
    """``item`` with every tensor that would bloat the file (a view) or needs a device copy replaced by
    ``clone_tensors_for_torch_save``'s CPU clone; other CPU tensors are kept as they are.

    Why not clone everything: copying a 300 MB state costs more than writing it (page faults on fresh
    memory), and saving is synchronous, so sharing the live CPU tensors is safe.
    """
    if torch.is_tensor(item):
        return clone_tensors_for_torch_save(item) if _needs_clone(item) else item.detach()
    if isinstance(item, dict):
        compacted = type(item)((key, compact_for_save(value)) for key, value in item.items())
        if hasattr(item, "_metadata"):
            compacted._metadata = item._metadata
        return compacted
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return type(item)(*(compact_for_save(value) for value in item))
    if isinstance(item, (list, tuple)):
        return type(item)(compact_for_save(value) for value in item)
    return item


def module_state_dict(module: torch.nn.Module, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    """The module's ``state_dict`` compacted for saving (:func:`compact_for_save`), without parameters that
    have ``requires_grad=False`` when ``exclude_frozen_parameters``."""
    state = module.state_dict()
    if exclude_frozen_parameters:
        frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
        for name in frozen:
            state.pop(name, None)
    return compact_for_save(state)


def load_file(path: str | os.PathLike, trusted: bool = False, map_location: Any = "cpu") -> Any:
    """``torch.load`` with ``weights_only=True`` (unless ``trusted``), with errors that name the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        names = _unsafe_globals(path) if _WEIGHTS_ONLY_MARK in str(exc) else []
        if names:
            raise UnsafeCheckpointError(_unsafe_message(path, names)) from exc
        raise _corrupt(path, exc) from exc  # not a torch zip file: the legacy unpickler choked on the bytes
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, AttributeError) as exc:
        raise _corrupt(path, exc) from exc


def _corrupt(path: str, exc: BaseException) -> CorruptCheckpointError:
    size = os.path.getsize(path)
    return CorruptCheckpointError(
        f"checkpoint file {path} ({size} bytes) cannot be read: it is truncated or corrupt "
        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}). Load an earlier tag "
        "or re-save it"
    )


def _unsafe_globals(path: str) -> list[str]:
    """The globals a well-formed torch file needs beyond the weights-only allowlist; [] if it can't be read."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # unreadable: the caller reports the file as corrupt instead
        return []


def _unsafe_message(path: str, names: list[str]) -> str:
    return (
        f"checkpoint file {path} holds Python objects that torch.load(weights_only=True) will not build: "
        f"{', '.join(names)}. "
        "If you trust the file, allow them with torch.serialization.add_safe_globals([...]) or load with "
        "EngineState(trusted_load=True); better, keep only tensors and plain types in client_state"
    )

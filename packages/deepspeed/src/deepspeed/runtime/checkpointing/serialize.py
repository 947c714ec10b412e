"""Reading and writing checkpoint files: ``torch.save`` through the atomic writer, safe ``torch.load``.

Loading uses ``weights_only=True``: our own content (tensors, dicts, lists, numbers, strings, ``torch.Size``)
needs no allowlist. A file holding other objects (e.g. an ``argparse.Namespace`` in the client state) fails
with an error naming them; allow them with ``torch.serialization.add_safe_globals`` or load a file you
trust with ``EngineState(trusted_load=True)``.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import threading
import zipfile
from collections import OrderedDict
from typing import Any

import torch

from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.checkpointing.atomic import Syncer, atomic_write, stage_write
from deepspeed.runtime.checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.utils.tensor_fragment import fragment_address

_WEIGHTS_ONLY_MARK = "Weights only load failed"
# The loss-scaler and fragment-address objects our ZeRO optimizer files hold, as DeepSpeed's do: plain data
# (numbers and a dtype), so a weights-only load may build them (also those of DeepSpeed's own files, same names)
torch.serialization.add_safe_globals([LossScaler, DynamicLossScaler, fragment_address])
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since 1.6 is a zip archive


def save_file(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically (temporary name, fsync, rename, fsync the directory)."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


def stage_file(obj: Any, path: str | os.PathLike, syncer: Syncer | None = None) -> str:
    """``torch.save(obj)`` under a temporary sibling of ``path`` (fsynced, by ``syncer`` in the background when
    given), without the zip CRC32s (:func:`save_without_crc`); returns it for ``atomic.commit``."""
    return stage_write(path, lambda handle: save_without_crc(obj, handle), syncer)


_crc_lock = threading.Lock()


def save_without_crc(obj: Any, handle: Any) -> None:
    """``torch.save(obj, handle)`` with the zip records' CRC32 fields left 0 (``set_crc32_options(False)``).

    Why: they are about 40 % of the CPU time of writing a file into the page cache (38 MB: 6 ms of 14; on a
    loaded host every CPU millisecond stretches to many of wall time), and no reader of ours or DeepSpeed's checks
    them: ``torch.load`` (plain or mmap) reads a file with a flipped data byte without
    a word (``tests/deepspeed/test_checkpoint_crc.py``). Damage our loaders do detect (truncation, a bad archive,
    bad pickles) does not depend on them. What changes: ``unzip -t`` / ``zipfile.testzip`` report CRC errors.
    The option is process-wide, so it is set and restored under a lock around this one call.
    """
    with _crc_lock:
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(obj, handle)
        finally:
            torch.serialization.set_crc32_options(before)


def _tensors(item: Any) -> Any:
    if torch.is_tensor(item):
        yield item
    elif isinstance(item, dict):
        for value in item.values():
            yield from _tensors(value)
    elif isinstance(item, (list, tuple)):
        for value in item:
            yield from _tensors(value)


def _covered_bytes(item: Any) -> dict[int, int]:
    """CPU storage (by address) -> bytes the distinct tensors of ``item`` hold in it."""
    seen, covered = set(), {}
    for tensor in _tensors(item):
        if tensor.device.type != "cpu":
            continue
        size = tensor.numel() * tensor.element_size()
        if (tensor.data_ptr(), size) in seen:  # the same values twice (tied weights): written once
            continue
        seen.add((tensor.data_ptr(), size))
        key = tensor.untyped_storage().data_ptr()
        covered[key] = covered.get(key, 0) + size
    return covered


def _needs_clone(tensor: torch.Tensor, covered: dict[int, int]) -> bool:
    """Off the CPU, or a view into a storage much larger than what the saved object holds of it (``torch.save``
    writes whole storages). Views that together cover their storage (ZeRO's parameters in one flat buffer) are
    saved as they are: the storage is written once, as DeepSpeed does, with no copy."""
    if tensor.device.type != "cpu":
        return True
    storage = tensor.untyped_storage().nbytes()
    if storage == tensor.numel() * tensor.element_size():
        return False
    return storage - covered.get(tensor.untyped_storage().data_ptr(), 0) > storage // 64


def compact_for_save(item: Any, share_views: bool = False) -> Any:
    """``item`` with every tensor that would bloat the file (a view into a larger storage) or needs a device copy
    replaced by ``clone_tensors_for_torch_save``'s CPU clone; other CPU tensors are kept as they are.

    ``share_views``: views that together cover their storage are kept too (see ``_needs_clone``), as DeepSpeed's
    training checkpoints hold them; files meant for other tools (``save_16bit_model``) leave it off, since some
    refuse tensors that share memory.

    Why not clone everything: copying a 300 MB state costs more than writing it (page faults on fresh
    memory), and saving is synchronous, so sharing the live CPU tensors is safe.
    """
    return _compact(item, _covered_bytes(item) if share_views else {})


def _compact(item: Any, covered: dict[int, int]) -> Any:
    if torch.is_tensor(item):
        return clone_tensors_for_torch_save(item) if _needs_clone(item, covered) else item.detach()
    if isinstance(item, dict):
        compacted = type(item)((key, _compact(value, covered)) for key, value in item.items())
        if hasattr(item, "_metadata"):
            compacted._metadata = item._metadata
        return compacted
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return type(item)(*(_compact(value, covered) for value in item))
    if isinstance(item, (list, tuple)):
        return type(item)(_compact(value, covered) for value in item)
    return item


def module_state_dict(module: torch.nn.Module, exclude_frozen_parameters: bool = False,
                      share_views: bool = False) -> dict[str, Any]:
    """The module's ``state_dict`` compacted for saving (:func:`compact_for_save`), without parameters that
    have ``requires_grad=False`` when ``exclude_frozen_parameters``."""
    state = module.state_dict()
    if exclude_frozen_parameters:
        frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
        for name in frozen:
            state.pop(name, None)
    return compact_for_save(state, share_views)


def load_file(path: str | os.PathLike, trusted: bool = False, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` with ``weights_only=True`` (unless ``trusted``), with errors that name the file.

    ``mmap=True`` maps a zip-format file instead of reading it: unpickling reads only the small ``data.pkl``
    and each tensor's bytes are read when first touched, straight from the page cache. Such tensors stay views of
    the file (private, copy-on-write), so a caller that keeps them copies them out (:func:`materialize`, or
    ``copy_`` into live tensors); the legacy (non-zip) format is read as usual.

    A missing file raises ``FileNotFoundError``; an unreadable one :class:`CorruptCheckpointError` whose
    ``reason`` says why in plain words ("empty file", "truncated (...)", "not a checkpoint file (unpickling
    failed: ...)"), never torch's advice to retry with ``weights_only=False`` (wrong for a damaged file).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        error = FileNotFoundError(errno.ENOENT, "checkpoint file does not exist", path)
        error.checkpoint_path, error.reason = path, "missing (the file does not exist)"  # type: ignore[attr-defined]
        raise error
    try:
        if mmap and _is_zip(path):
            return torch.load(path, map_location=map_location, weights_only=not trusted, mmap=True)
        return torch.load(path, map_location=map_location, weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        names = _unsafe_globals(path) if _WEIGHTS_ONLY_MARK in str(exc) else []
        if names:
            raise UnsafeCheckpointError(_unsafe_message(path, names)) from exc
        raise _corrupt(path, exc) from exc  # not a torch zip file: the unpickler choked on the bytes
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, AttributeError, IndexError, TypeError) as exc:
        raise _corrupt(path, exc) from exc


def _is_zip(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == _ZIP_MAGIC
    except OSError:
        return False


def materialize(item: Any) -> Any:
    """``item`` with every tensor replaced by a copy in memory of its own (tensors a ``load_file(mmap=True)``
    returned are views of the file); containers are rebuilt, other values kept."""
    if torch.is_tensor(item):
        return item.clone()
    if isinstance(item, dict):
        pairs = [(key, materialize(value)) for key, value in item.items()]
        try:
            out = type(item)(pairs)
        except TypeError:  # a dict subclass with another constructor
            out = dict(pairs)
        if hasattr(item, "_metadata"):
            out._metadata = item._metadata
        return out
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return type(item)(*(materialize(value) for value in item))
    if isinstance(item, (list, tuple)):
        return type(item)(materialize(value) for value in item)
    return item


def _corrupt(path: str, exc: BaseException) -> CorruptCheckpointError:
    reason = damage_reason(path, exc)
    return CorruptCheckpointError(f"checkpoint file {path} cannot be read: {reason}. Load an earlier tag or re-save "
                                  "it", path=path, reason=reason)


def damage_reason(path: str, exc: BaseException) -> str:
    """Why ``torch.load`` could not read ``path``, in a few words: empty, truncated, not a checkpoint file, or
    corrupt, with the loader's own detail (torch's advice to retry with ``weights_only=False`` left out)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError as os_exc:
        return f"unreadable ({type(os_exc).__name__}: {os_exc})"
    detail = _loader_detail(exc)
    if size == 0:
        return "empty file (0 bytes)"
    if head == _ZIP_MAGIC:
        if not zipfile.is_zipfile(path):  # a zip's directory is at its end: a start without an end was cut short
            return f"truncated ({size} bytes; the zip archive has no end: the write or copy stopped early)"
        return f"corrupt ({size} bytes; {detail})"
    if isinstance(exc, (pickle.UnpicklingError, EOFError)):
        return f"not a checkpoint file ({size} bytes; unpickling failed: {detail})"
    return f"not a checkpoint file ({size} bytes; {detail})"


def _loader_detail(exc: BaseException) -> str:
    """The informative part of a torch.load error: the weights-only unpickler's own error, or the first sentence."""
    text = str(exc)
    if _WEIGHTS_ONLY_MARK in text:
        # torch wraps the real error ("WeightsUnpickler error: Unsupported operand 120") in advice to load with
        # weights_only=False, which would run the file's code and could not read a damaged file anyway
        found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\s*\n|\nCheck the documentation|$)", text, re.S)
        text = " ".join(found.group(1).split()) if found else "the weights-only unpickler refused the bytes"
        opcode = re.fullmatch(r"Unsupported operand (\d+)", text)
        if opcode:
            text = f"unsupported pickle opcode {chr(int(opcode.group(1)))!r} ({opcode.group(1)})"
    else:
        text = text.split(". ")[0].splitlines()[0].rstrip(".") if text else "no detail"
    return f"{type(exc).__name__}: {text}"


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


def with_deepspeed_objects(obj: Any) -> Any:
    """``obj`` (a file's payload) with a ZeRO optimizer state's plain ``loss_scaler`` description turned into the
    object DeepSpeed's own optimizers pickle there (its ``deepspeed.runtime.fp16.loss_scaler`` class, same
    attributes), so DeepSpeed can load the file: its ZeRO loads take ``state['loss_scaler']`` as their scaler
    (stage 3 requires the key).
    Our readers take either form (a weights-only load reads the object as a placeholder holding its attributes).
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("optimizer_state_dict"), dict):
        return obj
    state = obj["optimizer_state_dict"]
    if isinstance(state.get("param_slice_mappings"), list):
        state = {**state, "param_slice_mappings": deepspeed_slice_mappings(state["param_slice_mappings"])}
    if "loss_scaler" not in state or not (state["loss_scaler"] is None or isinstance(state["loss_scaler"], dict)):
        # stage 1/2 without scaling leave the key out, which DeepSpeed's load accepts
        return obj if state is obj["optimizer_state_dict"] else {**obj, "optimizer_state_dict": state}
    return {**obj, "optimizer_state_dict": {**state, "loss_scaler": deepspeed_loss_scaler(state.get("loss_scaler"))}}


def deepspeed_slice_mappings(groups: list[Any]) -> list[Any]:
    """ZeRO stage 1/2 ``param_slice_mappings`` with each plain ``{"numel", "start"}`` turned into DeepSpeed's
    ``fragment_address`` in an ``OrderedDict`` per group, as DeepSpeed pickles them (its universal-checkpoint
    converter reads ``.start`` / ``.numel``); entries already in that form are kept."""
    def address(value: Any) -> Any:
        if isinstance(value, dict):
            return fragment_address(numel=int(value["numel"]), start=int(value["start"]))
        return value

    return [OrderedDict((name, address(value)) for name, value in group.items()) if isinstance(group, dict)
            else group for group in groups]


def deepspeed_loss_scaler(description: dict[str, Any] | None) -> Any:
    """DeepSpeed's scaler object for a plain description (``None``: no scaling, DeepSpeed's static scale 1)."""
    description = description or {"cur_scale": 1.0}
    if "scale_window" not in description:
        return LossScaler(scale=float(description["cur_scale"]))
    scaler = DynamicLossScaler(init_scale=float(description["cur_scale"]),
                               scale_window=int(description["scale_window"]),
                               min_scale=float(description.get("min_scale", 1.0)),
                               delayed_shift=int(description.get("delayed_shift", 1)),
                               consecutive_hysteresis=bool(description.get("consecutive_hysteresis", False)),
                               raise_error_at_min_scale=bool(description.get("raise_error_at_min_scale", True)))
    scaler.load_state_dict({**scaler.state_dict(), **{k: description[k] for k in scaler.state_dict()
                                                      if k in description}})
    if "scale_factor" in description:
        scaler.scale_factor = float(description["scale_factor"])
    return scaler

"""Plain entries of a ``torch.save``'d dict (ints, strings, lists, dicts) read without building its tensors.

A converter that needs a few small facts from every rank's file (a ZeRO-3 AutoEP rank's ``ep_rank`` in
``ds_autoep_layers``) need not unpickle the whole file through torch's weights-only unpickler and map a storage
for every tensor: this reads only the archive's ``data.pkl`` with the C unpickler, restricted to plain
containers. Every class or function the pickle names (tensors, storages, dtypes, anything else) becomes an inert
:class:`Opaque` stand-in: no code of the file runs, so reading is as safe as ``weights_only=True``, and nothing
that is not plain data comes back as if it were.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
from collections.abc import Sequence
from typing import Any

__all__ = ["Opaque", "StateMetadataError", "read_plain_entries"]

# The only globals a pickle may name and get for real: containers with no behaviour of their own.
_PLAIN = {("collections", "OrderedDict"): collections.OrderedDict, ("builtins", "set"): set,
          ("builtins", "frozenset"): frozenset, ("builtins", "dict"): dict, ("builtins", "list"): list,
          ("builtins", "tuple"): tuple}


class StateMetadataError(ValueError):
    """The file is not a ``torch.save`` zip archive holding a dict (the message names the file)."""


class Opaque:
    """Stands for anything but plain data (a tensor, a dtype, a class instance); keeps nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:  # a stand-in function: its "result"
        return Opaque()

    def __repr__(self) -> str:
        return "Opaque()"


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _PLAIN.get((module, name), Opaque)

    def persistent_load(self, pid: Any) -> Any:  # a tensor's storage: never read
        return None


def _pickle_bytes(path: str) -> bytes:
    if not zipfile.is_zipfile(path):
        raise StateMetadataError(f"{path}: not a torch.save zip archive (written by torch < 1.6 or another tool)")
    with zipfile.ZipFile(path) as archive:
        infos = [i for i in archive.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
        if len(infos) != 1:
            raise StateMetadataError(f"{path}: expected one data.pkl in the archive, found "
                                     f"{[i.filename for i in infos]}")
        info = infos[0]
        if info.compress_type != zipfile.ZIP_STORED:
            return archive.read(info)
    # torch writes its records stored, and may leave their CRC-32 unset (torch.serialization.config.save.
    # compute_crc32), which zipfile would refuse: read the record's bytes after its local header, as torch does
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise StateMetadataError(f"{path}: bad local header for {info.filename}")
        name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
        handle.seek(info.header_offset + 30 + name_len + extra_len)
        data = handle.read(info.file_size)
    if len(data) != info.file_size:
        raise StateMetadataError(f"{path}: {info.filename} is cut short")
    return data


def read_plain_entries(path: str | os.PathLike, keys: Sequence[str]) -> dict[str, Any]:
    """``{key: value}`` of the dict ``path`` holds, for the ``keys`` it has; tensors and objects inside the values
    are :class:`Opaque`. Reads the pickle only (no storage is mapped or read)."""
    path = os.fspath(path)
    try:
        state = _PlainUnpickler(io.BytesIO(_pickle_bytes(path))).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        if isinstance(exc, StateMetadataError):
            raise
        raise StateMetadataError(f"{path}: cannot read its pickle: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict):
        raise StateMetadataError(f"{path}: holds a {type(state).__name__}, expected a dict")
    return {key: state[key] for key in keys if key in state}

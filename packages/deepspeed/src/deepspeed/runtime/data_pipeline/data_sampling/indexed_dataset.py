"""Megatron/DeepSpeed ``MMapIndexedDataset`` files: a flat ``<prefix>.bin`` of items plus a ``<prefix>.idx`` index.

``.idx`` layout (little endian), as DeepSpeed 0.19.8 writes it:

- magic ``b"MMIDIDX\\x00\\x00"`` (9 bytes), version ``<Q`` = 1, dtype code ``<B`` (see :data:`dtypes`);
- item count ``<Q`` and document-index length ``<Q``;
- item sizes (elements, int32), item byte offsets into ``.bin`` (int64, exclusive prefix sums), document
  index (int64: item number where each document starts, beginning with 0).

``.bin`` is the items' elements back to back, C order, in the index's dtype. Reading memory-maps both files,
so a sample index of billions of entries costs no RAM.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1

#: dtype code in the ``.idx`` header -> (numpy dtype, torch dtype or None)
dtypes: dict[int, tuple[type, torch.dtype | None]] = {
    1: (np.uint8, torch.uint8),
    2: (np.int8, torch.int8),
    3: (np.int16, torch.int16),
    4: (np.int32, torch.int32),
    5: (np.int64, torch.int64),
    6: (np.uint16, None),
    7: (np.uint32, None),
    8: (np.uint64, None),
}
valid_dtypes = {np_dt for np_dt, _ in dtypes.values()} | {t for _, t in dtypes.values() if t is not None}


def _numpy_dtype(dtype: Any) -> type:
    """The numpy scalar type for ``dtype`` (a numpy type, numpy dtype or torch dtype); ValueError otherwise."""
    as_numpy = None
    if not isinstance(dtype, torch.dtype):
        try:
            as_numpy = np.dtype(dtype)
        except TypeError:
            pass
    for np_dt, torch_dt in dtypes.values():
        if dtype is torch_dt or as_numpy == np.dtype(np_dt):
            return np_dt
    raise ValueError(f"dtype {dtype!r} is not supported by indexed datasets; accepted: "
                     f"{', '.join(np.dtype(d).name for d, _ in dtypes.values())} (or their torch dtypes)")


def code(dtype: Any) -> int:
    """The header code of ``dtype``."""
    np_dt = _numpy_dtype(dtype)
    return next(c for c, (candidate, _) in dtypes.items() if candidate is np_dt)


def index_file_path(prefix_path: str) -> str:
    return prefix_path + ".idx"


def data_file_path(prefix_path: str) -> str:
    return prefix_path + ".bin"


def _read_only_map(path: str) -> np.ndarray:
    """The file's bytes, memory-mapped read-only (an empty array for an empty file, which mmap refuses)."""
    if os.path.getsize(path) == 0:
        return np.empty(0, dtype=np.uint8)
    return np.memmap(path, mode="r", order="C")


class _Index:
    """The parsed ``.idx`` file: dtype, item sizes, byte pointers and document index."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as stream:
            magic = stream.read(len(_MAGIC))
            if magic != _MAGIC:
                raise ValueError(f"{path} is not an MMapIndexedDataset index (magic {magic!r}, expected {_MAGIC!r})")
            (version,) = struct.unpack("<Q", stream.read(8))
            if version != _VERSION:
                raise ValueError(f"{path}: index version {version} is not supported; accepted: {_VERSION}")
            (dtype_code,) = struct.unpack("<B", stream.read(1))
            if dtype_code not in dtypes:
                raise ValueError(f"{path}: unknown dtype code {dtype_code}; accepted: {sorted(dtypes)}")
            self.dtype = dtypes[dtype_code][0]
            self.length, doc_count = struct.unpack("<QQ", stream.read(16))
            offset = stream.tell()
        buffer = _read_only_map(path)
        self.sizes = np.frombuffer(buffer, dtype=np.int32, count=self.length, offset=offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(buffer, dtype=np.int64, count=self.length, offset=offset)
        offset += self.pointers.nbytes
        self.doc_idx = np.frombuffer(buffer, dtype=np.int64, count=doc_count, offset=offset)


class MMapIndexedDataset(torch.utils.data.Dataset):
    """Read ``<path>.idx`` / ``<path>.bin``: ``ds[i]`` is item ``i`` as a read-only numpy array (a view into the
    memory map), ``ds[a:b]`` a list of them. ``skip_warmup`` is accepted for compatibility (no pre-read)."""

    def __init__(self, path: str, skip_warmup: bool = False) -> None:
        super().__init__()
        self._do_init(path)

    def _do_init(self, path: str) -> None:
        self._path = path
        for needed in (index_file_path(path), data_file_path(path)):
            if not os.path.isfile(needed):
                raise FileNotFoundError(f"MMapIndexedDataset: {needed} does not exist (path prefix {path!r})")
        self._index = _Index(index_file_path(path))
        self._bin_buffer = _read_only_map(data_file_path(path))

    def __getstate__(self) -> str:  # data loader workers reopen the maps instead of pickling them
        return self._path

    def __setstate__(self, state: str) -> None:
        self._do_init(state)

    def __len__(self) -> int:
        return int(self._index.length)

    def _item(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"item {i} is out of range for {self._path} ({n} items)")
        i %= n
        return np.frombuffer(self._bin_buffer, dtype=self._index.dtype, count=int(self._index.sizes[i]),
                             offset=int(self._index.pointers[i]))

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices into an indexed dataset must be contiguous (step 1), got step {step}")
            sizes = self._index.sizes[start:stop]
            return np.split(self.concatenated(start, stop), np.cumsum(sizes)[:-1]) if len(sizes) else []
        return self._item(int(idx))

    def concatenated(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Items ``start..stop-1`` back to back as one array (one read: items are contiguous in ``.bin``)."""
        stop = len(self) if stop is None else stop
        if start >= stop:
            return np.empty(0, dtype=self._index.dtype)
        count = int(self._index.sizes[start:stop].sum(dtype=np.int64))
        return np.frombuffer(self._bin_buffer, dtype=self._index.dtype, count=count,
                             offset=int(self._index.pointers[start]))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Part of item ``idx``: ``length`` elements from element ``offset`` (default: to the end)."""
        item = self._item(int(idx))
        return item[offset:] if length is None else item[offset:offset + length]

    @property
    def sizes(self) -> np.ndarray:
        return self._index.sizes

    def size(self, index: int) -> int:
        return int(self._index.sizes[index])

    @property
    def doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def get_doc_idx(self) -> np.ndarray:
        return self._index.doc_idx

    def set_doc_idx(self, doc_idx: np.ndarray) -> None:
        self._index.doc_idx = doc_idx

    @property
    def supports_prefetch(self) -> bool:
        return False

    @property
    def dtype(self) -> type:
        return self._index.dtype

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


def _write_index(path: str, dtype: type, sizes: Sequence[int], doc_idx: Sequence[int]) -> None:
    sizes64 = np.asarray(sizes, dtype=np.int64)
    pointers = np.zeros(len(sizes64), dtype=np.int64)
    if len(sizes64) > 1:  # exclusive prefix sum of the item sizes in bytes
        np.cumsum(sizes64[:-1] * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as stream:
        stream.write(_MAGIC)
        stream.write(struct.pack("<Q", _VERSION))
        stream.write(struct.pack("<B", code(dtype)))
        stream.write(struct.pack("<QQ", len(sizes64), len(doc_idx)))
        stream.write(sizes64.astype(np.int32).tobytes(order="C"))
        stream.write(pointers.tobytes(order="C"))
        stream.write(np.asarray(doc_idx, dtype=np.int64).tobytes(order="C"))


class MMapIndexedDatasetBuilder:
    """Write an indexed dataset: items go to ``out_file`` (the ``.bin``) as they come, ``finalize(idx_path)``
    writes the index. ``dtype``: a numpy or torch integer dtype of :data:`dtypes`."""

    def __init__(self, out_file: str, dtype: Any = np.int64) -> None:
        self._dtype = _numpy_dtype(dtype)
        self._data_file = open(out_file, "wb")  # noqa: SIM115 - stays open until finalize()
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, tensor: torch.Tensor) -> None:
        """Append one item (a tensor, flattened)."""
        self.add_item_numpy(np.asarray(tensor.detach().cpu().numpy()))

    def add_items(self, arr_list: Iterable[np.ndarray]) -> None:
        for arr in arr_list:
            self.add_item_numpy(np.asarray(arr))

    def add_scalars(self, values: np.ndarray) -> None:
        """Append every value of ``values`` as its own one-element item, in one write (the analyzer's files)."""
        array = np.ascontiguousarray(values, dtype=self._dtype).reshape(-1)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.extend([1] * int(array.size))

    def add_item_numpy(self, np_array: np.ndarray) -> None:
        array = np.ascontiguousarray(np_array, dtype=self._dtype).reshape(-1)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document: the next item starts a new one."""
        self._doc_idx.append(len(self._sizes))

    def merge_file_(self, another_file: str) -> None:
        """Append every item (and document boundary) of the indexed dataset at prefix ``another_file``."""
        index = _Index(index_file_path(another_file))
        if index.dtype is not self._dtype:
            raise ValueError(f"merge_file_: {another_file} holds {np.dtype(index.dtype).name}, this builder writes "
                             f"{np.dtype(self._dtype).name}")
        offset = len(self._sizes)
        self._sizes.extend(int(s) for s in index.sizes)
        self._doc_idx.extend(int(offset + d) for d in index.doc_idx[1:])
        with open(data_file_path(another_file), "rb") as source:
            shutil.copyfileobj(source, self._data_file)

    def finalize(self, index_file: str) -> None:
        """Close the data file and write the index to ``index_file``."""
        self._data_file.close()
        _write_index(index_file, self._dtype, self._sizes, self._doc_idx)


def make_builder(out_file: str, impl: str, vocab_size: int | None = None) -> MMapIndexedDatasetBuilder:
    """A builder for ``impl="mmap"`` (the one implementation here): uint16 tokens below a 65,500 vocabulary."""
    if impl != "mmap":
        raise ValueError(f"make_builder: impl={impl!r} is not supported; accepted: 'mmap'")
    dtype = np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32
    return MMapIndexedDatasetBuilder(out_file, dtype=dtype)


def make_dataset(path: str, impl: str, skip_warmup: bool = False) -> MMapIndexedDataset | None:
    """Open the ``impl="mmap"`` dataset at ``path`` (None when its files do not exist, as DeepSpeed does)."""
    if impl not in ("mmap", "infer"):
        raise ValueError(f"make_dataset: impl={impl!r} is not supported; accepted: 'mmap', 'infer'")
    if not MMapIndexedDataset.exists(path):
        return None
    return MMapIndexedDataset(path, skip_warmup)

"""Reuse of the CPU memory that holds gathered ZeRO-3 parameters, pass after pass.

A gather needs a buffer of ``W * P`` elements per parameter (or per packed batch). Allocated fresh each pass, a
buffer of a few MiB costs its first-touch page faults on every page (glibc hands large freed blocks back to the
OS, so the next pass faults again): a quarter of an MLP step's CPU time. Released whole values come back here
instead and the next gather of the same size takes them.

Ownership: a buffer handed out by :func:`take` belongs to the gather that took it, then to the parameter it is
installed in (``param.ds_full_base``), until ``release_one`` (or a new install) gives it back. :func:`give` keeps it
only when nothing else refers to its memory (the storage's use count: no view, no tensor saved for backward, no
user reference), so a kept buffer can be overwritten by the next gather without anyone seeing it. Kept and handed-out
bytes together stay within a quarter above the high-water mark of handed-out bytes alone (what the gathers needed
without a pool; older kept buffers are freed to make room); :func:`clear` (``empty_partition_cache``, engine
destroy) empties it.
Accelerator buffers are not pooled: the caching allocator already reuses them, with stream semantics this pool
does not track.
"""

from __future__ import annotations

import torch

_CPU = torch.device("cpu")
_free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
_bytes = {"pooled": 0, "live": 0, "high": 0}
_state = {"enabled": True, "fresh": 0}  # fresh: buffers allocated (not reused) since the interpreter started


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _exclusive(t: torch.Tensor) -> bool:
    """Nothing but ``t`` refers to its memory (2: ``t`` itself and the storage object asked)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(t.untyped_storage()._cdata) <= 2


def take(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D buffer of ``numel`` elements, contents undefined (a kept one, or new memory)."""
    if device != _CPU or not _state["enabled"]:
        return torch.empty(numel, dtype=dtype, device=device)
    kept = _free.get((numel, dtype))
    if kept:
        t = kept.pop()
        _bytes["pooled"] -= _nbytes(t)
    else:
        n = numel * torch.empty(0, dtype=dtype).element_size()
        _evict(_bytes["live"] + n)
        t = torch.empty(numel, dtype=dtype, device=device)
        _state["fresh"] += 1
    _bytes["live"] += _nbytes(t)
    _bytes["high"] = max(_bytes["high"], _bytes["live"])
    return t


def _limit() -> int:
    # a quarter of slack: transient buffers (a packed batch's receive buffer next to the values cut out of it, the
    # persistent parameters' refresh) would otherwise evict, at every pass, buffers the next gathers need
    return _bytes["high"] + _bytes["high"] // 4


def _evict(live: int) -> None:
    """Free kept buffers, oldest sizes first, until kept and ``live`` bytes fit under the limit (or nothing is
    kept)."""
    for key in list(_free):
        kept = _free[key]
        while kept and _bytes["pooled"] + live > _limit():
            _bytes["pooled"] -= _nbytes(kept.pop(0))
        if not kept:
            del _free[key]


def give(t: torch.Tensor) -> None:
    """``t`` (from :func:`take`) is no longer used by its owner: keep it for the next gather when nobody else
    refers to it and the pool stays under the high-water mark."""
    if t.device != _CPU or not _state["enabled"]:
        return
    n = _nbytes(t)
    _bytes["live"] = max(0, _bytes["live"] - n)
    if not _exclusive(t):
        return
    _free.setdefault((t.numel(), t.dtype), []).append(t)
    _bytes["pooled"] += n
    _evict(_bytes["live"])


def clear() -> None:
    """Free every kept buffer (what ``empty_partition_cache`` promises: no gathered memory left behind)."""
    _free.clear()
    _bytes["pooled"] = 0
    _bytes["high"] = _bytes["live"]


def pooled_bytes() -> int:
    return _bytes["pooled"]


def fresh_buffers() -> int:
    """Buffers :func:`take` allocated rather than reused, so far (a test's window on reuse)."""
    return _state["fresh"]


def set_enabled(enabled: bool) -> None:
    """Pool or not (off: every gather allocates and every release frees, the plain reference); emptied either way."""
    clear()
    _bytes["live"] = _bytes["high"] = 0
    _state["enabled"] = bool(enabled)

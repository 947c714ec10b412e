"""cffi ABI-mode bindings to libaio.so.1 and the few libc calls the aio module needs.

ABI mode (dlopen, no compiler) is used on purpose; the reasons are in the package docstring. The
``iocb``/``io_event`` layouts declared here are the kernel's (``linux/aio_abi.h``), a stable UAPI, and are
checked against their documented sizes before any is used; libaio's own helpers ``io_prep_pread`` and
friends are header-only inline functions, so the fields are filled in Python instead.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import cffi

_CDEF = """
typedef struct io_context *io_context_t;

struct iocb {
    uint64_t aio_data;
    uint32_t aio_key;
    int32_t  aio_rw_flags;
    uint16_t aio_lio_opcode;
    int16_t  aio_reqprio;
    uint32_t aio_fildes;
    uint64_t aio_buf;
    uint64_t aio_nbytes;
    int64_t  aio_offset;
    uint64_t aio_reserved2;
    uint32_t aio_flags;
    uint32_t aio_resfd;
};

struct io_event {
    uint64_t data;
    uint64_t obj;
    int64_t  res;
    int64_t  res2;
};

struct timespec { long tv_sec; long tv_nsec; };

int io_setup(int maxevents, io_context_t *ctxp);
int io_destroy(io_context_t ctx);
int io_submit(io_context_t ctx, long nr, struct iocb *ios[]);
int io_getevents(io_context_t ctx, long min_nr, long nr, struct io_event *events, struct timespec *timeout);
"""

_LIBC_CDEF = """
void *memcpy(void *dest, const void *src, size_t n);
int mlock(const void *addr, size_t len);
int fallocate(int fd, int mode, int64_t offset, int64_t len);
int munlock(const void *addr, size_t len);
struct ds_statx { uint32_t mask; uint8_t before_dio[148]; uint32_t dio_mem_align; uint32_t dio_offset_align;
                  uint8_t after_dio[96]; };
int statx(int dirfd, const char *pathname, int flags, unsigned int mask, struct ds_statx *statxbuf);
"""

IOCB_CMD_PREAD = 0
IOCB_CMD_PWRITE = 1
_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _load() -> None:
    if "ffi" in _state:
        return
    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    ffi.cdef(_LIBC_CDEF)
    _state["ffi"] = ffi
    _state["libc"] = ffi.dlopen(None)
    _state["lib"] = None
    _state["reason"] = None
    if not sys.platform.startswith("linux"):
        _state["reason"] = f"libaio is Linux-only (platform {sys.platform})"
        return
    if ffi.sizeof("struct iocb") != 64 or ffi.sizeof("struct io_event") != 32 or sys.byteorder != "little":
        _state["reason"] = "the kernel iocb layout declared here assumes a 64-bit little-endian machine"
        return
    if ffi.sizeof("struct ds_statx") != 256:
        _state["reason"] = "unexpected struct statx size"
        return
    try:
        _state["lib"] = ffi.dlopen("libaio.so.1")
    except OSError as exc:
        _state["reason"] = f"libaio.so.1 could not be loaded ({exc}); install Debian's libaio1 (scripts/system-deps.sh)"


def ffi() -> cffi.FFI:
    """The shared FFI object (declarations for libaio and libc)."""
    with _lock:
        _load()
    return _state["ffi"]


def libaio() -> Any | None:
    """The loaded libaio library, or None when it is unavailable (see :func:`unavailable_reason`)."""
    with _lock:
        _load()
    return _state["lib"]


def unavailable_reason() -> str | None:
    """Why libaio cannot be used here, or None when it can."""
    with _lock:
        _load()
    return _state["reason"]


def libc() -> Any:
    with _lock:
        _load()
    return _state["libc"]


def mlock(address: int, length: int) -> int:
    """Lock ``length`` bytes at ``address`` in RAM; returns 0 or the errno."""
    lib = libc()
    rc = lib.mlock(ffi().cast("void *", address), length)
    return 0 if rc == 0 else ffi().errno


def memcpy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` between raw addresses (libc memcpy; the GIL is released during the copy)."""
    f = ffi()
    libc().memcpy(f.cast("void *", dst), f.cast("void *", src), nbytes)


def munlock(address: int, length: int) -> None:
    libc().munlock(ffi().cast("void *", address), length)


def fallocate(fd: int, length: int, offset: int = 0) -> int:
    """Reserve ``length`` bytes of ``fd`` from ``offset`` (mode 0, so the size grows too); returns 0 or the errno."""
    rc = libc().fallocate(fd, 0, offset, length)
    return 0 if rc == 0 else ffi().errno


def dio_alignment(path: str) -> tuple[int, int] | None:
    """(memory, file offset) alignment in bytes that O_DIRECT needs for ``path``, from statx(STATX_DIOALIGN).

    None when the kernel or filesystem does not report it (the caller then assumes the page size).
    """
    f = ffi()
    buf = f.new("struct ds_statx *")
    try:
        rc = libc().statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, buf)
    except AttributeError:  # a libc without statx
        return None
    if rc != 0 or not (buf.mask & _STATX_DIOALIGN) or buf.dio_mem_align == 0 or buf.dio_offset_align == 0:
        return None
    return int(buf.dio_mem_align), int(buf.dio_offset_align)

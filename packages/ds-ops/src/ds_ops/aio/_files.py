"""Opening the file of a request: checks with clear errors, O_DIRECT when aligned, temporary names for writes.

Everything that can be checked before I/O starts is checked here, in the caller's thread, so even an
async request with a missing directory or a read past the end of the file fails at the call.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import stat
from dataclasses import dataclass

from ds_ops.aio import _libaio
from ds_ops.aio._errors import AioError
from ds_ops.aio._ops import Target

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_temp_counter = itertools.count()


@dataclass(frozen=True)
class Request:
    """What a handle method was asked to do. ``address``/``nbytes``: the tensor's memory; ``offset``: file bytes."""

    operation: str
    path: str
    address: int
    nbytes: int
    offset: int
    block_size: int
    allow_direct: bool
    stage_unaligned: bool = True


def _fail(req: Request, err: int | None, detail: str) -> AioError:
    return AioError(req.operation, req.path, err, detail)


def _os_error(req: Request, exc: OSError, doing: str) -> AioError:
    return _fail(req, exc.errno, f"{doing}: {exc.strerror}")


def direct_span(req: Request, path: str) -> tuple[int, bool]:
    """(leading bytes of the request that may use O_DIRECT on ``path``, whether they go through staging).

    The file offset and the block size must be aligned. A buffer that is not aligned in memory (plain torch
    tensors start 64 bytes into a page) is staged through aligned blocks when ``req.stage_unaligned``.
    """
    if not req.allow_direct or not _O_DIRECT:
        return 0, False
    mem_align, off_align = _libaio.dio_alignment(path) or (PAGE_SIZE, PAGE_SIZE)
    file_ok = req.offset % off_align == 0 and req.block_size % off_align == 0 and req.block_size % mem_align == 0
    span = req.nbytes - req.nbytes % off_align
    if not file_ok or span == 0:
        return 0, False
    if req.address % mem_align == 0:
        return span, False
    return (span, True) if req.stage_unaligned else (0, False)


def _open_direct(path: str, flags: int) -> int:
    """An O_DIRECT descriptor, or -1 when the filesystem refuses it (tmpfs on older kernels, FUSE, ...)."""
    try:
        return os.open(path, flags | _O_DIRECT | _O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return -1
        raise


def _with_direct(req: Request, target: Target, flags: int, path: str | None = None) -> Target:
    path = path or target.temp_path or target.path
    span, staged = direct_span(req, path)
    if span:
        try:
            target.direct_fd = _open_direct(path, flags)
        except OSError as exc:
            discard(target)
            raise _os_error(req, exc, "opening with O_DIRECT failed") from None
        target.direct_end = span if target.direct_fd >= 0 else 0
        target.staged = staged and target.direct_fd >= 0
    return target


def open_read(req: Request) -> Target:
    """Open ``req.path`` for reading after checking it exists and holds ``offset + nbytes`` bytes."""
    try:
        fd = os.open(req.path, os.O_RDONLY | _O_CLOEXEC)
    except FileNotFoundError:
        raise _fail(req, errno.ENOENT, "the file does not exist") from None
    except OSError as exc:
        raise _os_error(req, exc, "cannot open the file for reading") from None
    target = Target(path=req.path, fd=fd)
    _check_size(req, target)
    return _with_direct(req, target, os.O_RDONLY)


def _check_size(req: Request, target: Target) -> None:
    st = os.fstat(target.fd)
    if stat.S_ISREG(st.st_mode) and req.offset + req.nbytes > st.st_size:
        target.close()
        raise _fail(
            req,
            None,
            f"read past end of file: {req.nbytes} bytes at offset {req.offset} need {req.offset + req.nbytes} "
            f"bytes but the file holds {st.st_size}",
        )


def descriptor_name(fd: int) -> str:
    """What an open descriptor names, for messages: the file it points at, else ``/proc/self/fd/<fd>``."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"/proc/self/fd/{fd}"


def open_descriptor(req: Request, fd: int, write: bool, fsync: bool = False) -> Target:
    """Descriptors of our own onto the file the caller's open ``fd`` points at; the caller's stays theirs.

    The file is reopened through ``/proc/self/fd``: a new open file description, so pieces land at the
    offsets asked for even when the caller's descriptor has O_APPEND, and O_DIRECT is chosen per request
    as for a path (aligned pieces direct, the rest buffered) whatever the caller's flags. Where reopening
    is refused, duplicates of the caller's descriptor are used as they are.
    """
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        raise _fail(req, exc.errno, f"fd {fd} is not an open file descriptor") from None
    access = flags & os.O_ACCMODE
    if access == (os.O_RDONLY if write else os.O_WRONLY):
        raise _fail(req, errno.EBADF, f"fd {fd} is open {'read' if write else 'write'}-only")
    if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
        raise _fail(req, errno.ESPIPE, f"fd {fd} is not a regular file or block device")
    proc = f"/proc/self/fd/{fd}"
    want = os.O_WRONLY if write else os.O_RDONLY
    try:
        target = Target(path=req.path, fd=os.open(proc, want | _O_CLOEXEC), fsync=fsync)
    except OSError:
        target = Target(path=req.path, fd=os.dup(fd), fsync=fsync)
        if write:
            _extend(req, target)
        span, staged = direct_span(req, proc) if flags & _O_DIRECT else (0, False)
        if span:  # only the caller's direct descriptor: what O_DIRECT refuses fails, as it would for them
            target.direct_fd, target.direct_end, target.staged = os.dup(fd), span, staged
        if not write:
            _check_size(req, target)
        return target
    if write:
        _extend(req, target)
    else:
        _check_size(req, target)
    return _with_direct(req, target, want, proc)


def _check_directory(req: Request) -> str:
    directory = os.path.dirname(os.path.abspath(req.path))
    if not os.path.exists(directory):
        raise _fail(req, errno.ENOENT, f"the directory {directory!r} does not exist")
    if not os.path.isdir(directory):
        raise _fail(req, errno.ENOTDIR, f"{directory!r} is not a directory")
    if os.path.isdir(req.path):
        raise _fail(req, errno.EISDIR, "the path is a directory")
    return directory


def open_write(req: Request, whole_file: bool, fsync: bool) -> Target:
    """Open the file a write goes to.

    ``whole_file``: write a fresh temporary file next to ``path``, reserve its size, and let the op rename it
    over ``path`` only once every byte is written (removing it on failure). Otherwise write in place.
    """
    directory = _check_directory(req)
    if not whole_file:
        try:
            fd = os.open(req.path, os.O_WRONLY | os.O_CREAT | _O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _os_error(req, exc, "cannot open the file for writing") from None
        target = Target(path=req.path, fd=fd, fsync=fsync)
        _extend(req, target)
        return _with_direct(req, target, os.O_WRONLY)
    name = f".{os.path.basename(req.path)}.tmp-{os.getpid()}-{next(_temp_counter)}"
    temp = os.path.join(directory, name)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _os_error(req, exc, f"cannot create a file in {directory!r}") from None
    target = Target(path=req.path, fd=fd, temp_path=temp, fsync=fsync)
    _reserve(req, target)
    return _with_direct(req, target, os.O_WRONLY)


def _reserve(req: Request, target: Target) -> None:
    """Allocate the whole file up front: a full disk fails here, and O_DIRECT writes do not extend the file."""
    size = req.offset + req.nbytes
    if size == 0:
        return
    err = _libaio.fallocate(target.fd, size)
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        try:
            os.ftruncate(target.fd, size)
            err = 0
        except OSError as exc:
            err = exc.errno or errno.EIO
    if err:
        discard(target)
        raise _fail(req, err, f"cannot reserve {size} bytes: {os.strerror(err)}")


def _extend(req: Request, target: Target) -> None:
    """Reserve the part of an in-place write that lies past the end of the file before any piece is sent.

    O_DIRECT writes that extend a file run synchronously inside io_submit on common filesystems (ext4, xfs:
    block allocation and the size update), which serialises the queue; into reserved blocks they stay
    asynchronous. A full disk also fails here, before any byte is written. Never shrinks the file.
    """
    end = req.offset + req.nbytes
    st = os.fstat(target.fd)
    if req.nbytes == 0 or not stat.S_ISREG(st.st_mode) or end <= st.st_size:
        return
    err = _libaio.fallocate(target.fd, end - st.st_size, st.st_size)
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        try:
            os.ftruncate(target.fd, end)
            err = 0
        except OSError as exc:
            err = exc.errno or errno.EIO
    if err:
        discard(target)
        raise _fail(req, err, f"cannot extend the file to {end} bytes: {os.strerror(err)}")


def discard(target: Target) -> None:
    """Close a target that will not be used and remove its temporary file."""
    target.close()
    if target.temp_path is not None:
        try:
            os.unlink(target.temp_path)
        except FileNotFoundError:
            pass

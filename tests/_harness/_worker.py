"""Worker process of the distributed test harness: one rank of one test at a time, many tests per process.

The parent (see ``_pool``) starts workers with torch already imported (forkserver preload) and sends them
tasks. For each task the worker sets up a launcher-like environment, rendezvouses through a fresh TCPStore,
initialises the gloo process group, runs the body, tears the group down and restores what it changed.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before any group: see deepspeed/comm/comm.py)

from _harness import _pickling

_PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1
_DUMP_FILE: Any = None  # kept open for the life of the process: faulthandler writes to its descriptor


def worker_main(conn: Any, parent_pid: int, out_path: str, dump_path: str) -> None:
    """Entry point of a worker process (the target of ``multiprocessing.Process``)."""
    global _DUMP_FILE
    _die_with_parent(parent_pid)
    out_fd = _redirect_output(out_path)
    _DUMP_FILE = open(dump_path, "w")  # must outlive this function
    faulthandler.enable(file=_DUMP_FILE, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_DUMP_FILE, all_threads=True, chain=False)
    # Ctrl-C reaches the whole process group; the test process decides what happens to its workers (it
    # kills them), so an idle worker ignores it and a running body sees it only while it runs.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun does for several ranks per host: no oversubscription
    baseline = _snapshot()
    _send(conn, ("ready", os.getpid()))
    while True:
        try:
            task = pickle.loads(conn.recv_bytes())
        except EOFError:  # parent closed the pipe or died
            return
        if task["kind"] == "stop":
            return
        sys.stdout.flush()
        os.ftruncate(out_fd, 0)  # output is per task; the file is opened O_APPEND
        _send(conn, _run_task(conn, task, baseline))


def _send(conn: Any, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _die_with_parent(parent_pid: int) -> None:
    """Never outlive the test process: kernel parent-death signal plus a watchdog on the test's pid."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="harness-watchdog", daemon=True).start()


def _watch_parent(pid: int) -> None:
    while _alive(pid):
        time.sleep(_PARENT_POLL_S)
    os._exit(3)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed but not yet reaped parent still answers kill(0); its state says zombie
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _redirect_output(path: str) -> int:
    """Send this process's stdout/stderr (Python and C level) to ``path``; returns the descriptor."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # Fresh line-buffered streams: a forked worker would otherwise keep the parent's (pytest's capture
    # objects), and a rank killed while hung still shows what it printed.
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
    return fd


def _snapshot() -> dict:
    return {
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
        "seed": torch.initial_seed(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
    }


def _restore(base: dict) -> None:
    """Undo per-test changes a fresh process would not have (see the package docstring for the rest)."""
    os.environ.clear()
    os.environ.update(base["env"])
    os.chdir(base["cwd"])
    torch.set_num_threads(base["threads"])
    torch.set_default_dtype(base["dtype"])
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if flags != base["deterministic"]:  # the setter imports torch._inductor (~1 s): only when changed
        torch.use_deterministic_algorithms(base["deterministic"][0], warn_only=base["deterministic"][1])
    torch.set_grad_enabled(True)


def _enter_task(task: dict, base: dict) -> None:
    os.environ.clear()
    os.environ.update(task["env"])
    os.environ.update(
        RANK=str(task["rank"]),
        LOCAL_RANK=str(task["rank"]),
        WORLD_SIZE=str(task["world_size"]),
        LOCAL_WORLD_SIZE=str(task["world_size"]),
        MASTER_ADDR="127.0.0.1",
    )
    if task["port"] is not None:
        os.environ["MASTER_PORT"] = str(task["port"])
    os.chdir(task["cwd"])
    sys.path.extend(p for p in task["sys_path"] if p not in sys.path)
    torch.manual_seed(base["seed"])  # same RNG state as a fresh process


def _run_task(conn: Any, task: dict, base: dict) -> tuple:
    _enter_task(task, base)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        fn, args, kwargs = _pickling.loads(task["payload"])
        if task["init"]:
            _init_group(conn, task)
        result = fn(*args, **kwargs)
        try:
            data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(f"the body's return value {type(result).__name__} cannot be pickled: {exc}") from exc
        if dist.is_initialized():
            dist.barrier()  # no rank tears down while a peer still talks to it
            dist.destroy_process_group()
        return ("ok", data)
    except BaseException as exc:  # SystemExit/KeyboardInterrupt in a body are failures too
        return ("error", _format(exc))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stdout.flush()
        sys.stderr.flush()
        _restore(base)


def _init_group(conn: Any, task: dict) -> None:
    """Fresh rendezvous per test: rank 0 binds a TCPStore on a free port chosen by the kernel (no race with
    other processes picking ports) and the parent relays the port to the other ranks."""
    rank, world = task["rank"], task["world_size"]
    timeout = datetime.timedelta(seconds=task["timeout"])
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
        _send(conn, ("port", store.port))
    else:
        kind, port = pickle.loads(conn.recv_bytes())
        if kind != "port":
            raise RuntimeError(f"harness protocol error: expected the store port, got {kind!r}")
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)
    dist.init_process_group(task["backend"], store=store, rank=rank, world_size=world, timeout=timeout)


def _format(exc: BaseException) -> str:
    """The exception's traceback without this module's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))

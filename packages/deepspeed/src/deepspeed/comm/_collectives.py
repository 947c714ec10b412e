"""The collectives of ``deepspeed.comm``: torch.distributed calls plus what DeepSpeed adds to them.

Added: timing and size records for the ``comms_logger`` (a profiled collective is synchronised, async ones
included, so its latency is the op's; point-to-point ops are timed to their launch, as in DeepSpeed), and on
failure a note naming the op, this rank and the call number so a timed-out or broken collective says where it
happened. ``prof=True`` profiles one call even when the op is not in ``prof_ops``; ``log_name`` is the row it
is recorded under.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from deepspeed.comm import _state

# torch 2.13 renamed the flat-buffer collectives (the old names warn); older torch has only the old ones
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _caller() -> str:
    """The first function outside deepspeed.comm on the stack (the code that launched the op)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("deepspeed.comm"):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "<unknown>"


def _describe_failure(exc: BaseException, name: str, group: Any) -> None:
    rank = dist.get_rank() if dist.is_initialized() else -1
    world = dist.get_world_size(group) if dist.is_initialized() else -1
    note = (f"deepspeed.comm.{name} failed on rank {rank} (group size {world}), call #{_state.call_counts[name]} "
            f"of {name} on this rank")
    if hasattr(exc, "add_note"):
        exc.add_note(note)


# waiting on one half of an exchange before the other half is posted deadlocks: these are timed to launch only
_POINT_TO_POINT = {"isend", "irecv", "batch_isend_irecv"}


def _run(name: str, call: Callable[[], Any], msg_size: int, group: Any, prof: bool, log_name: str | None) -> Any:
    """Run one collective; record it when the comms logger selects it; annotate failures."""
    _state.call_counts[name] += 1
    logger = _state.comms_logger
    profiled = logger.should_profile(name, prof)
    try:
        if not profiled:
            return call()
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        accelerator.synchronize()
        start = time.perf_counter()
        work = call()
        if work is not None and hasattr(work, "wait") and name not in _POINT_TO_POINT:
            work.wait()
        accelerator.synchronize()
        latency_ms = (time.perf_counter() - start) * 1e3
    except Exception as exc:
        _describe_failure(exc, name, group)
        raise
    record = log_name or name
    if logger.debug:
        record = f"{record} | [Caller Func: {_caller()}]"
    logger.append(name, record, latency_ms, msg_size, dist.get_world_size(group))
    return work


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, prof: bool = False,
               log_name: str = "all_reduce"):
    return _run("all_reduce", lambda: dist.all_reduce(tensor, op, group, async_op), _nbytes(tensor), group, prof,
                log_name)


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
                         prof: bool = False, log_name: str = "inference_all_reduce"):
    """DeepSpeed's inference entry point: an all-reduce (torch picks the fastest kernel itself)."""
    return _run("inference_all_reduce", lambda: dist.all_reduce(tensor, op, group, async_op), _nbytes(tensor),
                group, prof, log_name)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, prof: bool = False,
           log_name: str = "reduce"):
    return _run("reduce", lambda: dist.reduce(tensor, dst, op, group, async_op), _nbytes(tensor), group, prof,
                log_name)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast"):
    return _run("broadcast", lambda: dist.broadcast(tensor, src, group, async_op), _nbytes(tensor), group, prof,
                log_name)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_gather"):
    return _run("all_gather", lambda: dist.all_gather(tensor_list, tensor, group, async_op), _nbytes(tensor), group,
                prof, log_name)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False, prof: bool = False, log_name: str = "all_gather_into_tensor"):
    return _run("all_gather_into_tensor",
                lambda: _all_gather_flat(output_tensor, input_tensor, group, async_op),
                _nbytes(input_tensor), group, prof, log_name)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, prof: bool = False, log_name: str = "reduce_scatter_tensor"):
    return _run("reduce_scatter_tensor",
                lambda: _reduce_scatter_flat(output_tensor, input_tensor, op, group, async_op),
                _nbytes(output_tensor), group, prof, log_name)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                      async_op: bool = False, prof: bool = False, debug: str | None = None):
    """Reduce-scatter of a flat ``tensor`` (``world`` equal chunks) into ``output_tensor`` (one chunk): the flat
    collective where torch has it, else the list form over the chunks (DeepSpeed's entry point for ZeRO-3's
    gradient reduction; ``debug``, DeepSpeed's caller label, is accepted and unused: failures name the caller)."""
    if dist.is_available() and (hasattr(dist, "reduce_scatter_tensor") or hasattr(dist, "reduce_scatter_single")):
        return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, prof=prof)
    world = dist.get_world_size(group)
    if tensor.numel() != world * output_tensor.numel():
        raise ValueError(f"reduce_scatter_fn: tensor has {tensor.numel()} elements; it must hold world size "
                         f"({world}) x output_tensor's {output_tensor.numel()}")
    return reduce_scatter(output_tensor, list(torch.chunk(tensor.reshape(-1), world)), op=op, group=group,
                          async_op=async_op, prof=prof)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None,
                   async_op: bool = False, prof: bool = False, log_name: str = "reduce_scatter"):
    return _run("reduce_scatter", lambda: dist.reduce_scatter(output, input_list, op, group, async_op),
                _nbytes(output), group, prof, log_name)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, prof: bool = False, log_name: str = "all_to_all_single"):
    return _run("all_to_all_single",
                lambda: dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group,
                                               async_op),
                _nbytes(tensor), group, prof, log_name)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group=None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_to_all"):
    return _run("all_to_all", lambda: dist.all_to_all(output_tensor_list, input_tensor_list, group, async_op),
                sum(_nbytes(t) for t in input_tensor_list), group, prof, log_name)


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False,
           prof: bool = False, log_name: str = "gather"):
    return _run("gather", lambda: dist.gather(tensor, gather_list, dst, group, async_op), _nbytes(tensor), group,
                prof, log_name)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False,
            prof: bool = False, log_name: str = "scatter"):
    return _run("scatter", lambda: dist.scatter(tensor, scatter_list, src, group, async_op), _nbytes(tensor), group,
                prof, log_name)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, prof: bool = False, log_name: str = "send"):
    return _run("send", lambda: dist.send(tensor, dst, group, tag), _nbytes(tensor), group, prof, log_name)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, prof: bool = False,
         log_name: str = "recv"):
    return _run("recv", lambda: dist.recv(tensor, src, group, tag), _nbytes(tensor), group, prof, log_name)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, prof: bool = False, log_name: str = "isend"):
    return _run("isend", lambda: dist.isend(tensor, dst, group, tag), _nbytes(tensor), group, prof, log_name)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv"):
    return _run("irecv", lambda: dist.irecv(tensor, src, group, tag), _nbytes(tensor), group, prof, log_name)


def batch_isend_irecv(p2p_op_list: list[dist.P2POp], prof: bool = False, log_name: str = "batch_isend_irecv"):
    """Point-to-point sends and receives launched together; the logged size is the bytes this rank sends."""
    sent = sum(_nbytes(op.tensor) for op in p2p_op_list if op.op is dist.isend)
    group = p2p_op_list[0].group if p2p_op_list else None
    return _run("batch_isend_irecv", lambda: dist.batch_isend_irecv(p2p_op_list), sent, group, prof, log_name)


def barrier(group=None, async_op: bool = False, device_ids=None, prof: bool = False, log_name: str = "barrier"):
    return _run("barrier", lambda: dist.barrier(group, async_op, device_ids), 0, group, prof, log_name)


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    """A barrier that names the ranks that did not arrive within ``timeout`` (gloo only, as in torch)."""
    return _run("barrier", lambda: dist.monitored_barrier(group, timeout, wait_all_ranks), 0, group, False, None)

"""Per-node profiles of an FX graph, written into ``node.meta`` for the scheduling passes.

``ProfilingInterpreter`` runs every node ``warmup`` + ``iteration`` times and records, averaged over ranks:
``device_time`` and ``wall_time`` (ms per run), ``alloc_mem`` (bytes the node left allocated), ``max_mem`` (peak
bytes above the start) and ``tensor_size`` (bytes of its output). ``MemoryProfilingInterpreter`` runs the graph once
and keeps ``(name, allocated, delta, peak)`` per node (maximum over ranks, one reduction for the whole run) in
``mem_record``.

Both run collectives, so a rank that fails on a node must not simply stop while the others head into a
collective: ``ProfilingInterpreter`` still takes part in that node's collectives, ``MemoryProfilingInterpreter``
skips ahead to the next node that may communicate; then every rank votes (``_abort_if_any_rank_failed``) and all
of them leave together. The caller then gets an incomplete profile: missing metadata is filled with zeros and the
graph is marked (``is_profile_incomplete``) so that passes planning from the profile skip it rather than trust it.
"""

from __future__ import annotations

import csv
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.fx import Graph, GraphModule, Interpreter, Node
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_all, tree_leaves

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from ..util import get_deepcompile_handle, is_comm_op, is_release_node

_PROFILE_META_DEFAULTS = {"device_time": 0.0, "wall_time": 0.0, "tensor_size": 0, "alloc_mem": 0, "max_mem": 0}
_STAT_KEYS = ("device_time", "wall_time", "alloc_mem", "max_mem", "tensor_size")  # the order of the ranks' reduce
_INCOMPLETE_ATTR = "_deepcompile_profile_incomplete"  # on the Graph
_INCOMPLETE_META = "deepcompile_profile_incomplete"  # on each node, survives node_copy into a rescheduled graph


def current_device() -> torch.device:
    """The accelerator's current device as a ``torch.device`` (CPU accelerators report an index, not a device)."""
    accelerator = get_accelerator()
    current = accelerator.current_device()
    if isinstance(current, int) and hasattr(accelerator, "current_device_name"):
        return torch.device(accelerator.current_device_name())
    return torch.device(current)


def _all_real_if_tensor(args: Any) -> bool:
    return tree_all(lambda v: not (torch.is_tensor(v) and is_fake(v)), args)


def _is_pinned(tensor: torch.Tensor) -> bool:
    try:
        return tensor.is_pinned()
    except RuntimeError:  # no accelerator to pin for
        return False


def _to(value: Any, device: torch.device) -> Any:
    if not torch.is_tensor(value):
        return value
    # A pinned host tensor in the graph is an offloaded value: its reader expects it on the host, and copying it
    # back would undo the offload and hide from the profile the memory it freed.
    if value.device.type == "cpu" and _is_pinned(value):
        return value
    with unset_fake_temporarily():
        return value.to(device)


def _args_to_key(args: Any) -> Any:
    def key(v: Any) -> str:
        if not torch.is_tensor(v):
            return str(v)
        if v.numel() == 1:  # scalars change results (e.g. a scale), so their value is part of the key
            try:
                return f"{v.dtype}{v.device}{v.item()}"
            except RuntimeError:
                return f"{v.dtype}{v.device}ptr{v.data_ptr()}"
        return f"{v.dtype}{v.device}{tuple(v.shape)}"

    return map_aggregate(args, key)


def _node_size(out: Any) -> int:
    return sum(v.element_size() * v.numel() for v in tree_leaves(out) if torch.is_tensor(v))


def _mark_profile_incomplete(graph: Graph) -> None:
    setattr(graph, _INCOMPLETE_ATTR, True)
    for node in graph.nodes:
        node.meta[_INCOMPLETE_META] = True


def is_profile_incomplete(graph: Graph | None) -> bool:
    """True when ``graph``'s profile stopped early or lacks metadata on some node (None: nothing to judge)."""
    if graph is None:
        return False
    return getattr(graph, _INCOMPLETE_ATTR, False) or any(n.meta.get(_INCOMPLETE_META, False) for n in graph.nodes)


def _backfill_missing_profile_metadata(graph: Graph, profile_complete: bool = True) -> None:
    """Give every node every profile key (zeros where missing); mark the graph incomplete if any was missing."""
    missing = any(key not in n.meta for n in graph.nodes for key in _PROFILE_META_DEFAULTS)
    if missing or not profile_complete:
        _mark_profile_incomplete(graph)
    for node in graph.nodes:
        for key, default in _PROFILE_META_DEFAULTS.items():
            node.meta.setdefault(key, default)


class ProfileAborted(RuntimeError):
    """Profiling failed on some rank; raised on every rank so that all of them stop at the same node."""


def _abort_if_any_rank_failed(error: BaseException | None, device: torch.device, distributed: bool = True) -> None:
    """One MAX vote over ``failed`` flags; raise ``ProfileAborted`` everywhere if any rank failed.

    A rank that failed while running a node and left would strand the others in that node's collectives until
    a watchdog killed the job; voting turns it into the same clean exception on every rank. (A failure inside a
    collective itself cannot be covered: the others are already waiting in a call this rank never makes.)
    """
    if not distributed or not dist.is_initialized():
        if error is not None:
            raise ProfileAborted(str(error)) from error
        return
    with unset_fake_temporarily():
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int, device=device)
        dist.all_reduce(flag, dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return
    if error is not None:
        raise ProfileAborted(str(error)) from error
    raise ProfileAborted("profiling failed on another rank")


def _run_warmup_for_profile(call_fn: Callable[[], Any], warmup: int) -> None:
    for _ in range(warmup):
        out = call_fn()
        del out  # before the next call, so warm-up outputs never pile up in memory


def _run_repeatedly_for_profile(call_fn: Callable[[], Any], iteration: int, start_events: list,
                                end_events: list) -> Any:
    """Run ``iteration`` timed calls; only the last output is kept (and returned)."""
    out = None
    for i in range(iteration):
        start_events[i].record()
        out = call_fn()
        end_events[i].record()
        if i + 1 < iteration:
            out = None
    return out


def _get_mem_usage_out_of_torch() -> int:
    """Device bytes held outside torch's allocator (other processes, NCCL buffers); 0 where NVML is absent."""
    if current_device().type != "cuda":
        return 0
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    except Exception:  # ImportError or any NVMLError: no reading, no adjustment
        return 0
    # Reserved rather than allocated: the allocator's own cache is torch's, not somebody else's.
    return max(0, used - get_accelerator().memory_reserved())


class HostEvent:
    """Timing event for the host, where ops run synchronously and the wall clock is the device clock."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1000.0


def timing_events(device: torch.device, n: int) -> list:
    """``n`` timing events for ``device``: the accelerator's own, or ``HostEvent`` on the CPU."""
    if device.type == "cpu":
        return [HostEvent() for _ in range(n)]
    return [get_accelerator().Event(enable_timing=True) for _ in range(n)]


def _fork_rng(device: torch.device):
    # Profiling reruns nodes (dropout...): keep the RNG streams of the real run untouched.
    return get_accelerator().random().fork_rng(devices=[] if device.type == "cpu" else [device])


class ProfilingInterpreter(Interpreter):
    """Time and memory of each node (see the module docstring); ``run`` never raises for a failing node."""

    def __init__(self, gm: GraphModule, iteration: int = 10, warmup: int = 5, debug_log: bool = False):
        super().__init__(gm)
        if iteration < 1 or warmup < 0:
            raise ValueError(f"ProfilingInterpreter needs iteration >= 1 and warmup >= 0, got {iteration}, {warmup}")
        self.nz3 = get_deepcompile_handle()
        self.iteration = iteration
        self.warmup = warmup
        self.device = current_device()
        self.cache: dict[tuple, tuple] = {}
        self.distributed = dist.is_initialized()
        self.allgather_mem: dict[int, int] = {}
        self.debug_log = debug_log
        self.mem_usage_out_of_torch = 0

    def run(self, *args) -> Any:
        out = None
        complete = True
        try:
            if not _all_real_if_tensor(args):
                raise ValueError("ProfilingInterpreter.run needs real tensors, got fake ones")
            self.nz3.enable_profiling(True)
            with unset_fake_temporarily(), _fork_rng(self.device):
                self.mem_usage_out_of_torch = _get_mem_usage_out_of_torch()
                out = super().run(*args)
        except Exception as e:  # a failed profile is reported and planned around, never fatal
            complete = False
            if not self.distributed or dist.get_rank() == 0:
                print(f"DeepCompile profiling failed; nodes not profiled get default metadata: {e}")
        finally:
            try:
                self.nz3.clear_all_gathered_params()
            finally:
                try:
                    self.nz3.enable_profiling(False)
                finally:
                    _backfill_missing_profile_metadata(self.graph, profile_complete=complete)
        return out

    def _gather_args(self, n: Node) -> tuple[tuple, dict, dict]:
        """The node's arguments with ZeRO-3 parameters gathered (and cast to their gather dtype) onto the device."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        cast_to_param: dict[int, torch.Tensor] = {}

        def gather(v: Any) -> Any:
            if not hasattr(v, "ds_id"):
                return v
            v.all_gather(param_list=[v])
            if hasattr(v, "ds_target_dtype"):
                cast = v.to(v.ds_target_dtype)
                cast_to_param[id(cast)] = v
                return cast
            return v

        args = map_aggregate(map_aggregate(args, gather), lambda v: _to(v, self.device))
        kwargs = map_aggregate(kwargs, lambda v: _to(v, self.device))
        return args, kwargs, cast_to_param

    def _cache_lookup(self, key: tuple) -> bool:
        """True when every rank has ``key`` cached (each rank must then skip the timed runs alike)."""
        miss = torch.tensor([0 if key in self.cache else 1], dtype=torch.int, device=self.device)
        if self.distributed:
            dist.all_reduce(miss, dist.ReduceOp.SUM)
        return int(miss.item()) == 0

    def _measure(self, n: Node, args: tuple, kwargs: dict, run_once: bool) -> tuple[Any, list[float]]:
        accelerator = get_accelerator()
        iteration = 1 if run_once else self.iteration
        starts, ends = timing_events(self.device, iteration), timing_events(self.device, iteration)
        accelerator.reset_peak_memory_stats()
        alloc_start = accelerator.memory_allocated()
        peak_start = accelerator.max_memory_allocated()

        fresh_gather = _is_allgather(n) and len(args) > 2  # (param, graph_id, ds_id, ...)

        def call() -> Any:
            if fresh_gather:  # every timed call really gathers, on every rank alike (nothing kept from before)
                self.nz3.invalidate_gathered_param(args[2])
            return getattr(self, n.op)(n.target, args, kwargs)

        _run_warmup_for_profile(call, 0 if run_once else self.warmup)
        if is_comm_op(n):
            if not self.distributed:
                raise RuntimeError(f"communication node {n.name} ({n.target}) needs torch.distributed initialized")
            dist.barrier()
        start = time.time()
        out = _run_repeatedly_for_profile(call, iteration, starts, ends)
        accelerator.synchronize()
        wall = (time.time() - start) / iteration * 1000.0
        if is_comm_op(n):
            dist.barrier()
        device_time = statistics.mean(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
        alloc = accelerator.memory_allocated() - alloc_start + self.mem_usage_out_of_torch
        peak = accelerator.max_memory_allocated() - peak_start + self.mem_usage_out_of_torch
        return out, [device_time, wall, alloc, peak, _node_size(out)]

    def _share_stats(self, n: Node, stats: list[float] | None, key: tuple) -> None:
        """Average the node's figures over ranks (a failed rank sends zeros but still takes part)."""
        with unset_fake_temporarily():
            vals = torch.tensor(stats or [0.0] * 5, dtype=torch.float64, device=self.device)
            if self.distributed:
                dist.all_reduce(vals, dist.ReduceOp.SUM)  # SUM / world: gloo has no AVG
        if stats is None:
            return
        if self.distributed:
            vals /= dist.get_world_size()
        device_time, wall, alloc, peak, size = vals.tolist()
        n.meta.update(device_time=device_time, wall_time=wall, alloc_mem=int(alloc), max_mem=int(peak),
                      tensor_size=int(size))
        self.cache[key] = tuple(n.meta[k] for k in _STAT_KEYS)

    def run_node(self, n: Node) -> Any:
        if n.op in ("placeholder", "output"):
            out = super().run_node(n)
            n.meta.update(device_time=0.0, wall_time=0.0, alloc_mem=0, max_mem=0, tensor_size=_node_size(out))
            return out

        args, kwargs, cast_to_param = self._gather_args(n)
        key = (n.target, _args_to_key(args), _args_to_key(kwargs))
        cached = self._cache_lookup(key)
        if cached:
            n.meta.update(zip(_STAT_KEYS, self.cache[key], strict=True))

        # Running the node is where profiling runs out of memory; it sits between collectives every rank must
        # reach, so an error is held until the vote below instead of unwinding past them.
        error, out, stats = None, None, None
        release = is_release_node(n)
        try:
            out, stats = self._measure(n, args, kwargs, run_once=cached or release)
            args = map_aggregate(args, lambda v: self._repartition(cast_to_param.get(id(v), v)))
        except Exception as e:
            error = e
        if not cached:
            self._share_stats(n, stats if error is None else None, key)
        _abort_if_any_rank_failed(error, self.device, self.distributed)

        if release and not cached:
            n.meta["alloc_mem"] = -self.allgather_mem.get(args[2], 0)
        if self.debug_log and (not self.distributed or dist.get_rank() == 0):
            print(f"{n.target} {n.meta['device_time']:.2f}ms {n.meta['wall_time']:.2f}ms "
                  f"alloc_mem={n.meta['alloc_mem']} max_mem={n.meta['max_mem']} tensor_size={n.meta['tensor_size']}")
        if _is_allgather(n):
            out = self._after_allgather(n, args)
        return out

    @staticmethod
    def _repartition(v: Any) -> Any:
        if hasattr(v, "ds_id") and not v.ds_persist:
            v.partition(param_list=[v], has_been_updated=False)
        return v

    def _after_allgather(self, n: Node, args: tuple) -> Any:
        # Downstream nodes get the parameter itself and gather it again when they run, so each node is measured
        # with the memory state of the real schedule rather than with every parameter left gathered.
        param = args[0]
        if not hasattr(param, "ds_id"):
            raise TypeError(f"{n.name}: allgather_param's input is not a ZeRO-3 parameter (no ds_id)")
        if not param.ds_persist:
            self.nz3.invalidate_gathered_param(args[2])
        if "dtype" in n.kwargs:
            param.ds_target_dtype = n.kwargs["dtype"]
        self.allgather_mem[param.ds_id] = n.meta["alloc_mem"]
        return param


def _is_allgather(n: Node) -> bool:
    dc = getattr(torch.ops, "dc", None)
    return dc is not None and hasattr(dc, "allgather_param") and n.target == dc.allgather_param.default


_COLLECTIVE_NAMESPACES = frozenset({"dc", "autotp", "c10d_functional", "_c10d_functional", "c10d"})


def _may_communicate(n: Node) -> bool:
    """A node that may enter a collective: a comm-tagged node or an operator of a communicating namespace."""
    if is_comm_op(n):
        return True
    namespace = getattr(n.target, "namespace", None)
    return n.op == "call_function" and namespace in _COLLECTIVE_NAMESPACES


class MemoryProfilingInterpreter(Interpreter):
    """Allocated and peak bytes after each node (maximum over ranks) in ``mem_record``; see the module docstring.

    The figures are kept per rank while the graph runs and reduced once at the end (one MAX over the whole
    record). A node that fails on one rank is held: that rank skips the nodes after it (their inputs are gone)
    until the next node that may communicate or the output, where every rank votes and all stop together; so the
    run costs one vote per communicating node plus one reduction, not a collective per node.

    ``profile_complete`` is False after a failed run, and ``mem_record`` is then empty; it is the same on every
    rank (a failure anywhere, fake inputs included, reaches every rank through the votes), except when a collective
    itself fails.
    """

    def __init__(self, gm: GraphModule, debug_log: bool = False):
        super().__init__(gm)
        self.nz3 = get_deepcompile_handle()
        self.device = current_device()
        self.mem_record: list[tuple[str, int, int, int]] = []
        self.last_alloc = get_accelerator().memory_allocated()
        self.profile_complete = True
        self.mem_usage_out_of_torch = 0
        self.node_counter = 0
        self.node_num = len(gm.graph.nodes)
        self.debug_log = debug_log
        self._local: list[tuple[str, int, int]] = []  # (name, allocated, peak) on this rank
        self._error: BaseException | None = None
        self._distributed = False

    def run(self, *args) -> Any:
        out = None
        self.profile_complete = True
        self.mem_record.clear()
        self._local, self._error = [], None
        self._distributed = dist.is_initialized()
        try:
            if not _all_real_if_tensor(args):  # held like a node's failure: every rank still takes the same votes
                self._error = ValueError("MemoryProfilingInterpreter.run needs real tensors, got fake ones")
            self.nz3.enable_profiling(True)
            self.mem_usage_out_of_torch = _get_mem_usage_out_of_torch()
            with unset_fake_temporarily(), _fork_rng(self.device):
                out = super().run(*args)
                self._finish()
        except Exception as e:  # reported through profile_complete; the passes then skip their planning
            self.profile_complete = False
            self.mem_record.clear()
            print(f"DeepCompile memory profiling failed: {e}")
        finally:
            try:
                self.nz3.clear_all_gathered_params()
            finally:
                self.nz3.enable_profiling(False)
        return out

    def _finish(self) -> None:
        """The last vote, then one MAX over every rank's record (all ranks ran the same nodes)."""
        _abort_if_any_rank_failed(self._error, self.device, self._distributed)
        values = [v for _, alloc, peak in self._local for v in (alloc, peak)]
        if self._distributed and values:
            with unset_fake_temporarily():
                reduced = torch.tensor(values, dtype=torch.int64, device=self.device)
                dist.all_reduce(reduced, dist.ReduceOp.MAX)
                values = [int(v) for v in reduced.tolist()]
        last = self.last_alloc
        for i, (name, _, _) in enumerate(self._local):
            alloc, peak = values[2 * i], values[2 * i + 1]
            self.mem_record.append((name, alloc, alloc - last, peak))
            last = alloc
        self.last_alloc = last
        if self.debug_log and (not self._distributed or dist.get_rank() == 0):
            for i, (name, alloc, delta, peak) in enumerate(self.mem_record):
                print(f"memory profile {i + 1}/{self.node_num} {name}: {alloc / 2**20:.2f} MiB "
                      f"(delta {delta / 2**20:.2f} MiB, peak {peak / 2**20:.2f} MiB)")

    def run_node(self, n: Node) -> Any:
        if n.op == "output" or _may_communicate(n):  # every rank reaches here: a failure elsewhere stops us all
            _abort_if_any_rank_failed(self._error, self.device, self._distributed)
        if self._error is not None:
            return None  # this rank failed earlier: wait for the next vote without running anything
        accelerator = get_accelerator()
        accelerator.reset_peak_memory_stats()
        out = None
        try:
            if n.op in ("placeholder", "output"):
                out = super().run_node(n)
            else:
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                args = map_aggregate(args, lambda v: _to(v, self.device))
                kwargs = map_aggregate(kwargs, lambda v: _to(v, self.device))
                out = getattr(self, n.op)(n.target, args, kwargs)
                del args, kwargs
        except Exception as e:  # held for the next vote: the other ranks may be heading into a collective
            self._error = e
            if n.op == "output":
                _abort_if_any_rank_failed(self._error, self.device, self._distributed)
            return None
        alloc = accelerator.memory_allocated() + self.mem_usage_out_of_torch
        peak = accelerator.max_memory_allocated() + self.mem_usage_out_of_torch
        self._local.append((n.name, alloc, peak))
        self.node_counter += 1
        return out

    def dump(self, path: str) -> None:
        """Write ``mem_record`` as CSV (columns node, memory, delta, max_mem; bytes)."""
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["node", "memory", "delta", "max_mem"])
            writer.writerows(self.mem_record)

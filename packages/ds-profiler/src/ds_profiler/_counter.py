"""Counting machinery: a TorchDispatchMode that prices every aten op, and module hooks that say which
module is running, so each op's cost goes to the innermost module and, when it returns, to its callers.

Why a dispatch mode: it sees every op however it was reached (``F.*``, ``torch.*``, tensor methods,
operators, C++ modules such as ``nn.LSTM``) and also the backward pass, which no Python-level patch can.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from ds_profiler._grad_owner import GradOwners, sequence_mark
from ds_profiler._rules import RULES
from ds_profiler._rules_pointwise import first_tensor


@dataclass
class ModuleStats:
    """One module's profile, inclusive of everything it called. MACs and FLOPs are counts, duration seconds."""

    macs: int = 0
    flops: int = 0
    duration: float = 0.0
    calls: int = 0
    ignored: bool = False
    backward_macs: int = 0
    backward_flops: int = 0


@dataclass
class OpStats:
    """Per aten op (e.g. ``aten.addmm``): how often it ran and what it cost."""

    calls: int = 0
    macs: int = 0
    flops: int = 0


# The autograd engine's current graph task: -1 outside backward, so != -1 marks the ops the engine runs
# (backward, and recomputation under activation checkpointing). Bound once: it is asked for every op.
_graph_task_id = torch._C._current_graph_task_id
_clock = time.perf_counter


# Per op overload, decided once: (overload, composite?, rule or None, op name, callable). Keyed by id()
# because an OpOverload's __hash__ is Python code; the overload is kept in the plan and compared, so a
# reused id (an overload of a deleted custom op library) is never mistaken for another op. The callable is
# the overload's C++ op object when it has one (calling it skips OpOverload.__call__'s Python frame).
Plan = tuple[Any, bool, Any, str, Callable]
_PLANS: dict[int, Plan] = {}


def plan_for(func: Any) -> Plan:
    """The cached pricing plan of one aten overload."""
    plan = _PLANS.get(id(func))
    if plan is None or plan[0] is not func:
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
        packet = func._overloadpacket
        call = getattr(func, "_op", None)
        plan = _PLANS[id(func)] = (func, composite, RULES.get(packet), str(packet), call if callable(call) else func)
    return plan


def _floating_work(out: Any, args: tuple) -> bool:
    """Whether an op is floating-point work, judged by its output's dtype (else its first input's): integer
    and bool results (index arithmetic, masks) cost nothing."""
    tensor = out if type(out) is torch.Tensor else first_tensor(out)
    if tensor is None:
        tensor = first_tensor(args)
    return tensor is not None and (tensor.is_floating_point() or tensor.is_complex())


class Recorder:
    """The state of one profile: the live module stack, per-module and per-op totals, backward totals."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        # frames: [module, macs, flops, start_time, ignored, grad_mark, stats]
        self.stack: list[list[Any]] = []
        self.ignore_depth = 0
        self.modules: dict[nn.Module, ModuleStats] = {}
        self.forward_ops: dict[str, OpStats] = {}
        self.backward_ops: dict[str, OpStats] = {}
        self.backward = OpStats()
        self.grad_owners = GradOwners()

    def reset(self) -> None:
        """Zero every count, keeping the registered modules and which of them are ignored."""
        for stats in self.modules.values():
            stats.macs = stats.flops = stats.calls = stats.backward_macs = stats.backward_flops = 0
            stats.duration = 0.0
        self.forward_ops.clear()
        self.backward_ops.clear()
        self.backward = OpStats()

    def on_op(self, rule: Callable, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """Price one aten call and book it to the running module (forward) or to backward."""
        if _graph_task_id() != -1:
            self._on_backward_op(rule, name, args, kwargs, out)
            return
        stack = self.stack
        if not stack or self.ignore_depth:
            return  # outside the model's forward, or inside an ignored module
        if not _floating_work(out, args):
            return  # integer/bool arithmetic (index math, masks) is not floating-point work
        macs, flops = rule(args, kwargs, out)
        frame = stack[-1]
        frame[1] += macs
        frame[2] += flops
        entry = self.forward_ops.get(name)
        if entry is None:
            entry = self.forward_ops[name] = OpStats()
        entry.calls += 1
        entry.macs += macs
        entry.flops += flops

    def _on_backward_op(self, rule: Callable, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        owner = self.grad_owners.running_owner()
        if owner == () or not _floating_work(out, args):
            return  # the backward of an ignored module, or integer work
        macs, flops = rule(args, kwargs, out)
        entry = self.backward_ops.get(name)
        if entry is None:
            entry = self.backward_ops[name] = OpStats()
        entry.calls += 1
        entry.macs += macs
        entry.flops += flops
        self.backward.calls += 1
        self.backward.macs += macs
        self.backward.flops += flops
        for module in owner or ():
            stats = self.modules[module]
            stats.backward_macs += macs
            stats.backward_flops += flops

    def pre_hook(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: push a frame for ``module``."""
        if _graph_task_id() != -1:
            return
        stats = self.modules[module]
        if stats.ignored:
            self.ignore_depth += 1
        mark = sequence_mark()
        if self.sync is not None:
            self.sync()
        self.stack.append([module, 0, 0, _clock(), stats.ignored, mark, stats])

    def post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook (also run when forward raises): pop the frame, book it, hand its cost to the caller."""
        if _graph_task_id() != -1:
            return
        if self.sync is not None:
            self.sync()
        end = _clock()
        stack = self.stack
        if stack and stack[-1][0] is module:  # the normal case: the innermost frame is this call's
            frame = stack.pop()
            if frame[4]:
                self.ignore_depth -= 1
        else:
            depth = next((i for i in range(len(stack) - 1, -1, -1) if stack[i][0] is module), None)
            if depth is None:
                return  # no frame: profiling started while this module was already running
            while len(stack) > depth:  # frames above it belong to calls that never returned normally
                frame = stack.pop()
                self.ignore_depth -= frame[4]
        stats = frame[6]
        stats.calls += 1
        stats.macs += frame[1]
        stats.flops += frame[2]
        stats.duration += end - frame[3]
        if stack:
            stack[-1][1] += frame[1]
            stack[-1][2] += frame[2]
        if frame[5] is not None:
            chain = tuple(f[0] for f in self.stack) + (module,)
            ignored_chain = any(f[4] for f in self.stack) or frame[4]
            walk_start = _clock()
            self.grad_owners.tag(output, frame[5], () if ignored_chain else chain)
            spent = _clock() - walk_start
            for caller in self.stack:  # the walk is profiler overhead, not the callers' latency
                caller[3] += spent


class CountingMode(TorchDispatchMode):
    """Runs every aten op unchanged and reports its price to a ``Recorder``."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in torch._disable_dynamo: importing torch._dynamo costs
        # seconds on first use and the wrapper costs per op. This mode never runs under torch.compile tracing.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # The hot path of the profiler: every aten op of the model comes through here. Free ops (views,
        # copies, indexing: most of a transformer's ops) cost one dict lookup on top of torch's own work.
        plan = _PLANS.get(id(func))
        if plan is None or plan[0] is not func:
            plan = plan_for(func)
        if plan[1]:
            # Composite ops (linear, matmul, layer_norm, ...) normally decompose above this mode; under
            # inference_mode they arrive whole. Decompose them here, with the mode on, so their parts are
            # priced exactly as in every other mode.
            with self:
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        out = plan[4](*args, **kwargs) if kwargs else plan[4](*args)
        if plan[2] is not None:
            self.recorder.on_op(plan[2], plan[3], args, kwargs or {}, out)
        return out


def walk(model: nn.Module, ignore: tuple[type, ...]) -> Iterable[tuple[nn.Module, bool]]:
    """Each distinct module once, with whether it is ignored; an ignored module's submodules are skipped."""
    seen: set[int] = set()
    pending = [model]
    while pending:
        module = pending.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        ignored = bool(ignore) and isinstance(module, ignore)
        yield module, ignored
        if not ignored:
            pending.extend(reversed(list(module.children())))


class Session:
    """Hooks plus the dispatch mode for one profiling window; ``close()`` removes every trace."""

    def __init__(self, model: nn.Module, recorder: Recorder, ignore: tuple[type, ...]) -> None:
        self.recorder = recorder
        self.handles: list[Any] = []
        self.mode: CountingMode | None = None
        try:
            for module, ignored in walk(model, ignore):
                recorder.modules.setdefault(module, ModuleStats()).ignored = ignored
                self.handles.append(module.register_forward_pre_hook(recorder.pre_hook))
                self.handles.append(module.register_forward_hook(recorder.post_hook, always_call=True))
            self.mode = CountingMode(recorder)
            self.mode.__enter__()
            # The first op under a new dispatch mode pays torch's one-off setup (lazy imports); pay it here,
            # outside any module, so it does not land in the first module's latency.
            torch.zeros(1).add_(1)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the hooks and leave the dispatch mode; idempotent."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        mode, self.mode = self.mode, None
        self.recorder.stack.clear()
        self.recorder.ignore_depth = 0
        if mode is not None:
            current = _get_current_dispatch_mode()
            if current is not mode:
                raise RuntimeError(
                    f"cannot stop profiling: the innermost torch dispatch mode is {type(current).__name__}, "
                    "not the profiler's; exit the modes entered after start_profile() first"
                )
            mode.__exit__(None, None, None)

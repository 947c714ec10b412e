"""Gather and release scheduling: module hooks that make each module's parameters whole right before it runs
(forward and backward) and partitioned again after, unless they are persistent.

A *gather unit* is a module and the parameters it owns directly, or, for a leaf module (``z3_leaf_module``,
the ``leaf_module`` config block, or a module finer than ``stage3_module_granularity_threshold``), its whole
subtree, gathered at once. Hooks per unit:
- forward pre-hook: fetch (wait for a prefetched gather, or gather now), then prefetch what the trace says
  comes next; the tensors the module receives are routed through ``_AfterBackward`` so that, in backward,
  the unit is released once gradients for its inputs exist (its own backward is done);
- forward post-hook: release (or keep when the trace says the unit is reused soon), and hook the outputs so
  the unit is fetched again when backward reaches it.
Parameters used outside their module (``F.linear(h, self.embed.weight)`` in a parent's forward, or returned
from a forward) become *external* parameters of the running unit, found through the parameter dictionaries
(``_ZeroParamDict``) or the outputs, or registered by hand (``register_external_parameter``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ds_zero.zero3._collectives import PendingGather, gather_now, start_gather
from ds_zero.zero3._prefetch import Lookahead, TraceCache, TraceSettings
from ds_zero.zero3.gather_pool import clear as clear_full_pool
from ds_zero.zero3.leaf import apply_granularity_threshold
from ds_zero.zero3.linear import install_functional_linear, remove_functional_linear, use_memory_efficient_linear
from ds_zero.zero3.param import ZeroParamStatus, is_partitioned, prefetch_partitions, release_one

logger = logging.getLogger("DeepSpeed")
_UNIT_IDS = itertools.count()


@dataclass(frozen=True)
class ScheduleSettings:
    """The gather/release knobs of ``zero_optimization`` (element counts)."""

    prefetch_bucket_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2 ** 63 - 1
    module_granularity_threshold: int = 0
    log_trace_cache_warnings: bool = False
    memory_efficient_linear: bool = True


class GatherUnit:
    """A module and the parameters gathered together for it.

    ``revision`` (shared by all units) counts changes of any unit's external parameters, so indexes built over
    the units know when to rebuild without recounting them."""

    revision = 0

    def __init__(self, module: torch.nn.Module, name: str, params: list[torch.nn.Parameter]) -> None:
        self.id = next(_UNIT_IDS)
        self.module_ref = weakref.ref(module)
        self.name = name or type(module).__name__
        self.params = params
        self.external: list[torch.nn.Parameter] = []

    def all_params(self) -> list[torch.nn.Parameter]:
        return self.params + self.external if self.external else self.params

    def add_external(self, param: torch.nn.Parameter) -> None:
        """Gather ``param`` with this unit from now on (a no-op when it already is)."""
        if all(param is not q for q in self.all_params()):
            self.external.append(param)
            param.is_external_param = True
            GatherUnit.revision += 1

    def remove_external(self, param: torch.nn.Parameter) -> None:
        self.external = [q for q in self.external if q is not param]
        GatherUnit.revision += 1

    def transient_numel(self) -> int:
        return sum(p.ds_numel for p in self.all_params() if not p.ds_persist)


def is_z3_leaf(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "_z3_leaf", False))


def build_units(root: torch.nn.Module, is_leaf: Callable[[str, torch.nn.Module], bool],
                granularity_threshold: int = 0) -> list[GatherUnit]:
    apply_granularity_threshold(root, granularity_threshold)
    units = []

    def walk(module: torch.nn.Module, name: str) -> None:
        if is_leaf(name, module):  # the model itself too (a tiny model under the granularity threshold)
            params = list(dict.fromkeys(module.parameters()))
            for p in params:
                p.ds_z3_leaf_module = module
            if params or module is root:
                units.append(GatherUnit(module, name, params))
            return
        params = list(module.parameters(recurse=False))
        if params or module is root:
            units.append(GatherUnit(module, name, params))
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name)

    walk(root, "")
    for unit in units:
        module = unit.module_ref()
        module.__dict__["_z3_unit"] = unit
        for param in module.__dict__.get("_external_params", {}).values():
            unit.add_external(param)
    return units


class _AfterBackward(torch.autograd.Function):
    """Identity on a module's input tensors; its backward runs once the module's backward is done."""

    @staticmethod
    def forward(ctx: Any, scheduler: Any, unit: GatherUnit, *tensors: torch.Tensor) -> Any:
        ctx.scheduler, ctx.unit = scheduler, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.scheduler.after_backward(ctx.unit)
        return (None, None, *grads)


class _ZeroParamDict(dict):
    """A module's ``_parameters``: reading another unit's parameter while a unit runs gathers it and makes it an
    external parameter of that unit (the automatic external-parameter detection of the spec), also when it happens
    to be gathered already (prefetched for its own module): it is released with its module, and backward must
    gather it again for the reader."""

    scheduler_ref: Any = None

    def __init__(self, parent_module: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # DeepSpeed's ZeROOrderedDict(parent_module, ...) signature
        self._parent_module = parent_module

    def __getitem__(self, key: str) -> Any:
        param = super().__getitem__(key)
        if param is not None and hasattr(param, "ds_status"):
            scheduler = self.scheduler_ref() if self.scheduler_ref is not None else None
            if scheduler is not None and scheduler.active:
                scheduler.adopt_external(param)
        return param


def ensure_param_table(module: Any, keep_original: bool = True) -> None:
    """Make ``module._parameters`` a :class:`_ZeroParamDict` (DeepSpeed's ``ensure_zero_ordered_dict``): a plain
    dict is copied into one, the first container kept as ``module._original_parameters`` when ``keep_original``
    (the scheduler does not keep it: it would hold parameters replaced later); a table already converted, a
    missing one or a non-dict container is left alone."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, _ZeroParamDict) or not isinstance(params, dict):
        return
    if keep_original and "_original_parameters" not in getattr(module, "__dict__", {}):
        module._original_parameters = params
    module._parameters = _ZeroParamDict(module, params)


def _external_parameters(module: torch.nn.Module) -> list[tuple[int, torch.nn.Parameter]]:
    """``module.ds_external_parameters()``: the parameters registered as external to it, as DeepSpeed lists them."""
    return list(module.__dict__.get("_external_params", {}).items())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _route_inputs(value: Any, routed: Iterator[torch.Tensor], ids: set[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return next(routed) if id(value) in ids else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_route_inputs(v, routed, ids) for v in value)
    if isinstance(value, list):
        return [_route_inputs(v, routed, ids) for v in value]
    return value


class ParamScheduler:
    """Installs the hooks on ``root`` and runs the gathers and releases of its partitioned parameters."""

    def __init__(self, root: torch.nn.Module, settings: ScheduleSettings,
                 is_leaf: Callable[[str, torch.nn.Module], bool] | None = None) -> None:
        self.root = root
        self.settings = settings
        self.trace_settings = TraceSettings(settings.prefetch_bucket_numel, settings.max_live_numel,
                                            settings.max_reuse_distance)
        self.units = build_units(root, is_leaf or (lambda name, m: is_z3_leaf(m)),
                                 settings.module_granularity_threshold)
        self.by_id = {u.id: u for u in self.units}
        self.cache = TraceCache()
        self.lookahead = Lookahead()
        self.stack: list[GatherUnit] = []
        self.pending: dict[int, PendingGather] = {}  # ds_id -> the gather bringing it
        self.in_pass = False
        self.backward_pending = False
        self.ends_with_backward = False  # set by the optimizer, whose reducer ends each training pass
        self._fetched_at: dict[int, int] = {}
        self._after_own_backward = False
        self._landed: dict[int, set[int]] = {}  # unit id -> ds_ids whose gradient landed in this backward
        self._indexed_revision = -1
        self._swappers: list[Any] | None = None
        self._params_cache: list[torch.nn.Parameter] | None = None  # unit id -> trace position of its last fetch
        self._handles: list[Any] = []
        self.on_remove: list[Callable[[], None]] = []  # run by remove() (engine destroy): ZeRO-Infinity cleanup
        self.quantize_frozen_block: int | None = None  # elements per int8 scale, with quantized frozen weights
        self._name_params()
        self._mark_persistent()
        self._install()
        self._owns_linear = settings.memory_efficient_linear
        if settings.memory_efficient_linear:
            install_functional_linear(self)
            use_memory_efficient_linear(root)

    # ---- setup ---------------------------------------------------------------------------------------------
    def _name_params(self) -> None:
        for name, p in self.root.named_parameters():
            if is_partitioned(p) and not getattr(p, "ds_name", None):
                p.ds_name = name

    def partitioned_params(self) -> list[torch.nn.Parameter]:
        return [p for p in dict.fromkeys(self.root.parameters()) if is_partitioned(p)]

    def _mark_persistent(self) -> None:
        s = self.settings
        total = 0
        persistent = []
        for p in self.partitioned_params():
            if p.ds_numel <= s.param_persistence_threshold and total + p.ds_numel <= s.model_persistence_threshold:
                p.ds_persist = True
                total += p.ds_numel
                persistent.append(p)
        self.persistent = persistent
        self.refresh_persistent()

    def refresh_persistent(self) -> None:
        """Gather the persistent parameters again (after the partitions changed: a step, a load)."""
        for p in self.persistent:  # released first: the new values take the stale ones' pooled memory
            if p.ds_status is ZeroParamStatus.AVAILABLE:
                release_one(p, include_persistent=True)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        gather_now(self.persistent)

    def _install(self) -> None:
        self._adopt_tables(self.root.modules())

    def _adopt_tables(self, modules: Iterable[torch.nn.Module]) -> None:
        ref = weakref.ref(self)
        for module in modules:
            ensure_param_table(module, keep_original=False)
            module._parameters.scheduler_ref = ref
            if "ds_external_parameters" not in module.__dict__:  # DeepSpeed's method on every ZeRO-3 module
                module.ds_external_parameters = types.MethodType(_external_parameters, module)
        for unit in self.units:
            module = unit.module_ref()
            self._handles.append(module.register_forward_pre_hook(self._hook(self._pre_forward, unit),
                                                                  with_kwargs=True, prepend=True))
            self._handles.append(module.register_forward_hook(self._hook(self._post_forward, unit),
                                                              always_call=True))

    def _hook(self, method: Callable, unit: GatherUnit) -> Callable:
        ref = weakref.ref(self)

        def hook(module: torch.nn.Module, *args: Any) -> Any:
            scheduler = ref()
            return None if scheduler is None else method(unit, *args)
        return hook

    # ---- the hooks off and on again (generation with every weight gathered: TRL, the hybrid engine) -----------
    @property
    def hook_handles(self) -> list[Any]:
        """The forward hooks' handles (DeepSpeed's ``parameter_offload.forward_hooks``)."""
        return self._handles

    @hook_handles.setter
    def hook_handles(self, handles: list[Any]) -> None:
        self._handles = list(handles)

    def remove_hooks(self) -> None:
        """Take the gather/release hooks off; the parameters keep their state. ``install_hooks`` restores them."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def install_hooks(self) -> None:
        """The hooks on every unit again (replacing any still on); the next pass records a fresh trace."""
        self.remove_hooks()
        self._install()
        self.invalidate_trace()

    def invalidate_trace(self) -> None:
        """Forget the recorded module order (a pass ran without the hooks, or another order is coming)."""
        self.cache = TraceCache()
        self.lookahead.reset()

    @property
    def trace_invalid(self) -> bool:
        return self.cache.trace is None

    @contextlib.contextmanager
    def hooks_removed(self) -> Iterator[None]:
        """No gathers or releases by the hooks inside the block (its caller holds the weights it needs)."""
        self.release_all()  # nothing stays half-fetched when the hooks go
        self.remove_hooks()
        try:
            yield
        finally:
            self.install_hooks()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for swapper in self.swappers():
            swapper.close()
        for callback in self.on_remove:
            callback()
        self.on_remove = []
        clear_full_pool()
        if self._owns_linear:
            self._owns_linear = False
            remove_functional_linear(self)
        for module in self.root.modules():
            if isinstance(module._parameters, _ZeroParamDict):
                module._parameters.scheduler_ref = None

    @property
    def active(self) -> bool:
        return bool(self.stack)

    # ---- forward ---------------------------------------------------------------------------------------------
    def _pre_forward(self, unit: GatherUnit, args: tuple, kwargs: dict) -> Any:
        if not self.in_pass:
            self.in_pass = True
            # submodules attached after the hooks were installed get a parameter table too (as DeepSpeed's
            # forward prologue converts them), so reads of partitioned parameters from them are seen
            late = [m for m in self.root.modules() if not isinstance(m._parameters, _ZeroParamDict)]
            if late:
                self._adopt_tables(late)
        self.stack.append(unit)
        self.fetch(unit)
        if not torch.is_grad_enabled():
            return None
        flat = [t for t in itertools.chain(_tensors(args), _tensors(kwargs)) if t.requires_grad]
        if not flat:
            return None
        routed = iter(_AfterBackward.apply(self, unit, *flat))
        ids = {id(t) for t in flat}
        new_args = _route_inputs(args, routed, ids)
        new_kwargs = {k: _route_inputs(v, routed, ids) for k, v in kwargs.items()}
        return new_args, new_kwargs

    def _post_forward(self, unit: GatherUnit, args: tuple, output: Any) -> None:
        if self.stack and self.stack[-1] is unit:
            self.stack.pop()
        self._adopt_returned(output)
        grads = [t for t in _tensors(output) if t.requires_grad]
        if grads and torch.is_grad_enabled():
            self.backward_pending = True
            ref = weakref.ref(self)

            def before_backward(_: Any) -> None:
                scheduler = ref()
                if scheduler is not None:
                    scheduler.before_backward(unit)
            torch.autograd.graph.register_multi_grad_hook(grads, before_backward, mode="any")
        self.release(unit)
        if unit.module_ref() is self.root and not (self.backward_pending and self.ends_with_backward):
            self.end_pass()  # forward only (evaluation): the pass ends with the model's forward

    def _adopt_returned(self, output: Any) -> None:
        """A parameter returned from a forward is used by the caller: it becomes external to the caller's unit."""
        for t in _tensors(output):
            if isinstance(t, torch.nn.Parameter) and is_partitioned(t) and self.stack:
                owner = self.stack[-1]
                owner.add_external(t)
                t.ds_active_sub_modules.add(owner.id)

    def adopt_external(self, param: torch.nn.Parameter) -> None:
        unit = self.stack[-1]
        if unit.id in param.ds_active_sub_modules and param.ds_status is ZeroParamStatus.AVAILABLE:
            return  # the running unit's own parameter, or one it adopted already
        unit.add_external(param)
        param.ds_active_sub_modules.add(unit.id)
        self._wait_or_gather([param])

    # ---- backward --------------------------------------------------------------------------------------------
    def before_backward(self, unit: GatherUnit) -> None:
        self.fetch(unit)

    def grad_landed(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient is final for this backward: a unit whose every parameter trains and has its
        gradient is done with backward, even when no input of it asked for a gradient (``_AfterBackward`` never
        runs for a model's first layer). Units with frozen parameters wait: those may still be read."""
        for unit in self._units_of(param):
            params = unit.all_params()
            if any(not p.requires_grad for p in params) or unit in self.stack:
                continue
            landed = self._landed.setdefault(unit.id, set())
            landed.add(param.ds_id)
            if len(landed) == len(params):
                self.after_backward(unit)

    def _units_of(self, param: torch.nn.Parameter) -> list[GatherUnit]:
        if GatherUnit.revision != self._indexed_revision:  # external parameters changed since the index was built
            self._unit_index: dict[int, list[GatherUnit]] = {}
            for unit in self.units:
                for p in unit.all_params():
                    self._unit_index.setdefault(p.ds_id, []).append(unit)
            self._indexed_revision = GatherUnit.revision
        return self._unit_index.get(param.ds_id, [])

    def after_backward(self, unit: GatherUnit) -> None:
        self._after_own_backward = True
        try:
            self.release(unit)
        finally:
            self._after_own_backward = False

    # ---- fetch / release -------------------------------------------------------------------------------------
    def _wait_or_gather(self, params: list[torch.nn.Parameter]) -> None:
        waiting = []
        for p in params:
            pending = self.pending.get(p.ds_id)
            if pending is not None and pending not in waiting:
                waiting.append(pending)
        for pending in waiting:
            pending.wait()
            for key in [k for k, v in self.pending.items() if v is pending]:
                del self.pending[key]
        gather_now(params)

    def fetch(self, unit: GatherUnit) -> None:
        params = unit.all_params()
        for p in params:
            p.ds_active_sub_modules.add(unit.id)
        on_track = self.cache.record(unit.id, unit.transient_numel())
        self._fetched_at[unit.id] = self.cache.position
        self._wait_or_gather(params)
        if on_track:
            self._prefetch(self.cache.position)

    def _live_numel(self) -> int:
        # the module tree is walked once per pass, not at every prefetch (75 of 531 ms per GPT-2 step otherwise)
        if self._params_cache is None:
            self._params_cache = self.partitioned_params()
        return sum(p.ds_numel for p in self._params_cache
                   if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist)

    def _prefetch(self, position: int) -> None:
        s, trace = self.trace_settings, self.cache.trace
        if s.prefetch_numel <= 0 or trace is None:
            return
        wanted: list[torch.nn.Parameter] = []
        budget, fetching, look = s.max_live_numel - self._live_numel(), 0, self.lookahead
        j = max(look.next, position + 1)
        while j < len(trace.units) and fetching < s.prefetch_numel:
            params = [p for p in self.by_id[trace.units[j]].all_params() if not p.ds_persist]
            need = [p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE
                    and all(p is not q for q in wanted)]
            numel = sum(p.ds_numel for p in need)
            if numel > budget:  # max_live_parameters: this position is visited again once memory is released
                break
            for p in params:
                look.passed(p.ds_id, j)
            wanted += need
            budget -= numel
            fetching += numel
            j += 1
        look.next = j
        if wanted:
            pending = start_gather(wanted)
            for p in wanted:
                self.pending[p.ds_id] = pending
        self._prefetch_from_nvme(trace, position)

    def _prefetch_from_nvme(self, trace: Any, position: int) -> None:
        """ZeRO-Infinity: start reading from NVMe the partitions of the units the trace says come after the
        ones being gathered (twice the gather prefetch distance), so their gathers find them in memory; the
        swapper stops at its buffer pool's size."""
        if not self.swappers():
            return
        ahead = trace.ahead(position, 2 * max(self.trace_settings.prefetch_numel, 1))
        params = [p for j in ahead for p in self.by_id[trace.units[j]].all_params()
                  if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        prefetch_partitions(list(dict.fromkeys(params)))

    def swappers(self) -> list[Any]:
        """The ZeRO-Infinity parameter swappers holding partitions of this model (usually none or one)."""
        if self._swappers is None:
            found = {id(p.ds_swapper): p.ds_swapper for p in self.partitioned_params()
                     if getattr(p, "ds_swapper", None) is not None}
            self._swappers = list(found.values())
        return self._swappers

    def release(self, unit: GatherUnit) -> None:
        for p in unit.all_params():
            p.ds_active_sub_modules.discard(unit.id)
        if torch._C._current_graph_task_id() != -1 and not self._after_own_backward:
            return  # a recomputation (activation checkpointing) inside backward: its backward needs the values
        pos, trace = self._fetched_at.get(unit.id, -1), self.cache.trace
        if self.cache.on_track and trace is not None and 0 <= pos < len(trace.units):
            distance = trace.reuse_distance(pos)
            if distance is not None and distance < self.trace_settings.max_reuse_distance:
                return
        position = self.cache.position if self.cache.on_track else None
        for p in unit.all_params():
            if not p.ds_active_sub_modules and p.ds_id not in self.pending \
                    and (position is None or not self.lookahead.kept(p.ds_id, position)):
                release_one(p)

    def release_all(self, include_persistent: bool = False) -> None:
        """Wait for gathers in flight and release every non-persistent parameter (and, with
        ``include_persistent``, the persistent ones too: they are gathered again when next used)."""
        for pending in set(self.pending.values()):
            pending.wait()
        self.pending.clear()
        for p in self.partitioned_params():
            p.ds_active_sub_modules.clear()
            if include_persistent and p.ds_persist:
                p.ds_persist = False
                release_one(p)
                p.ds_persist = True
            else:
                release_one(p)
        if include_persistent:  # empty_partition_cache: no gathered memory stays behind, kept for reuse or not
            clear_full_pool()

    def end_pass(self) -> None:
        """A pass (forward, plus backward when there was one) is over: release everything and close the trace."""
        self.release_all()
        self.stack.clear()
        self.in_pass = self.backward_pending = False
        self._fetched_at.clear()
        self.lookahead.reset()
        self._landed.clear()
        self._params_cache = None
        for swapper in self.swappers():  # partitions read ahead for a pass that went elsewhere
            swapper.release_all()
        if self.cache.end_pass() and self.settings.log_trace_cache_warnings:
            logger.warning("ZeRO-3: the order in which modules ran changed since the last pass; the prefetch trace "
                           "was rebuilt (dynamic models prefetch less)")

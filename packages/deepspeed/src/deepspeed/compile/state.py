"""One DeepCompile engine's state (``DeepCompileState``), and which engine's state the process is using.

``engine.compile`` creates one state per engine: its pass schedule, the captured graphs' order, profiles and
parameter managers, the pass times, the all-gather cost model, and its runtime handle (the registered parameters
and gathered values the ``torch.ops.dc`` operators act on). The engine's backend reaches its state through its
closure and its graphs through their ``graph_id`` (``register_graph``: each ``dc`` operator carries the id of the
graph it was inserted in); ``engine.destroy()`` releases that state alone (``release``), so destroying one engine
never clears another's, and a new engine never inherits a stale schedule, profile or cost model.

The *active* state (``active_state``) is the one the last DeepCompile forward of any engine ran with (set by
``activate``), or a detached default state when none is: module-level names DeepSpeed exposes (``backend.
remaining_schedule``, ``backend.profiling_results``, ``util.get_deepcompile_handle()``, ...) read it. What stays
process-wide on purpose: the pass registry by name (``backend.opt_passes``), the operator library, and the
captured-backward machinery of ``patch_compiled_func`` (it patches ``torch.autograd.Function``, which is
process-wide; its frames are keyed by owner so engines never consume each other's inputs).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from deepspeed.compile.custom_ops.handle import DeepCompileHandle


class GraphOrder:
    """Captured graphs in first-run order, one per frame: ``(graph_id, needs_backward)``."""

    def __init__(self) -> None:
        self.frames: OrderedDict[int, tuple[int, bool | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.frames)

    def add_graph(self, graph_id: int, frame_id: int) -> None:
        self.frames.setdefault(frame_id, (graph_id, None))

    def set_needs_backward(self, frame_id: int, needs_backward: bool) -> None:
        if frame_id in self.frames:
            self.frames[frame_id] = (self.frames[frame_id][0], needs_backward)

    def get_graph_order(self) -> list[tuple[int, bool]]:
        unknown = [f for f, (_, nb) in self.frames.items() if not isinstance(nb, bool)]
        if unknown:
            raise RuntimeError(f"DeepCompile: graph order asked before frames {unknown} were compiled")
        return list(self.frames.values())

    def clear(self) -> None:
        self.frames.clear()


class DeepCompileState:
    """Everything one DeepCompile engine compiles and runs with (see the module docstring)."""

    def __init__(self) -> None:
        self.handle = DeepCompileHandle()
        self.remaining_schedule: deque | None = None
        self.next_passes: list[Callable] | None = None
        self.param_manager: dict[int, Any] = {}
        self.graph_order = GraphOrder()
        self.frames_partitioned: set[int] = set()
        self.profiling_results: dict[int, Any] = {}
        self.opt_pass_times: list[tuple[str, int, int, float]] = []
        self.owned_frames: set = set()  # (owner token, frame id) of captured backward inputs
        self.comm_profile: list[tuple[int, float]] | None = None  # the all-gather cost model's measured points
        self.pre_backward_hooks: list[Callable[[bool], None]] = []
        self.post_backward_hooks: list[Callable[[], None]] = []
        self.backward_started = False
        self.graph_ids: set[int] = set()
        # the optimizer the optimizer-state offload pass was bound to for this engine (that pass's binding is
        # process-wide: one such engine at a time, checked at each forward)
        self.offload_opt_states_optimizer: Any = None

    def reset_compiled(self) -> None:
        """A new schedule step: every graph is captured and rewritten again (the cost model stays)."""
        self.handle.reset()
        self.graph_order.clear()
        self.profiling_results.clear()
        self.param_manager.clear()
        self.frames_partitioned.clear()


_default = DeepCompileState()
_active: DeepCompileState | None = None
_graph_owners: dict[int, weakref.ref] = {}


def active_state() -> DeepCompileState:
    """The state of the engine whose DeepCompile forward ran last, or the detached default state."""
    return _active if _active is not None else _default


def activate(state: DeepCompileState) -> None:
    """``state`` becomes the active one (an engine's compile and each of its forwards)."""
    global _active
    _active = state


def attach_engine_state(engine: Any) -> DeepCompileState:
    """A new state for ``engine`` (``engine._deepcompile_state``), made active: ``engine.compile`` calls this
    before it registers anything. A state the engine had from an earlier compile is released first."""
    old = engine.__dict__.get("_deepcompile_state")
    if old is not None:
        release(old)
    state = engine._deepcompile_state = DeepCompileState()
    engine._deepcompile_owned_frames = state.owned_frames
    activate(state)
    return state


def register_graph(graph_id: int, state: DeepCompileState) -> None:
    """The ``dc`` operators of graph ``graph_id`` act on ``state`` (the id of a freed graph may be reused by a new
    one: the latest registration wins, made before the new graph runs)."""
    _graph_owners[graph_id] = weakref.ref(state)
    state.graph_ids.add(graph_id)


def state_for_graph(graph_id: int) -> DeepCompileState:
    """The state that compiled graph ``graph_id``; the active one for a graph no engine registered."""
    owner = _graph_owners.get(graph_id)
    state = owner() if owner is not None else None
    return state if state is not None else active_state()


def get_handle(graph_id: int | None = None) -> DeepCompileHandle:
    """The runtime handle of graph ``graph_id``'s engine, or of the active state."""
    return (active_state() if graph_id is None else state_for_graph(graph_id)).handle


def release(state: DeepCompileState) -> None:
    """``engine.destroy()``: forget ``state``'s graphs and contents; the active state falls back to the default
    when it was this one. Another engine's state is untouched."""
    global _active
    for graph_id in state.graph_ids:
        owner = _graph_owners.get(graph_id)
        if owner is not None and owner() in (state, None):
            del _graph_owners[graph_id]
    state.graph_ids.clear()
    state.reset_compiled()
    state.handle.cleanup()
    state.remaining_schedule, state.next_passes, state.comm_profile = None, None, None
    state.offload_opt_states_optimizer = None
    state.pre_backward_hooks.clear()
    state.post_backward_hooks.clear()
    if _active is state:
        _active = None

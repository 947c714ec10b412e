"""ZeRO-3 parameters read eagerly around a DeepCompile forward (outside the compiled graphs: graph breaks, Dynamo's
guards, user code between forwards), and when they go back to their partitions.

While a forward runs under ``deepcompile_z3_forward_context``, a module's ``_parameters`` table
(``ZeROOrderedDict``) gathers a released parameter that eager code reads and records it here
(``record_gathered_param``); a read made by Dynamo's guard evaluation (``is_dynamo_guard_evaluation``) is not
gathered, since guards must see the released parameter the compiled graph expects. A forward with a backward
claims the parameters it gathered (``record_forward_graph``) until its backward completes
(``record_backward_start`` + ``complete_backward``): they are released then, or, for a forward without backward,
before the next forward (``release_available_params_for_next_forward``). A parameter a user's
``GatheredParameters`` block also holds (its context depth attribute) is left to that block.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed.runtime.zero import parameter_offload
from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

OWNER_ATTR = "_ds_z3_eager_fallback_owner"
CONTEXT_DEPTH_ATTR = "_ds_z3_gathered_param_context_depth"

_ACTIVE_FALLBACK: Any = None


def get_active_z3_eager_fallback() -> Any:
    return _ACTIVE_FALLBACK


def record_z3_eager_fallback_param(param: Any) -> bool:
    """Record an eager gather with the active fallback; False when none is active."""
    fallback = get_active_z3_eager_fallback()
    if fallback is None:
        return False
    fallback.record_gathered_param(param)
    return True


def is_dynamo_guard_evaluation() -> bool:
    """Is this parameter read made by Dynamo's guard code (a frame of ``torch._dynamo.guards`` on the stack)?"""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch._dynamo.guards":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def deepcompile_z3_forward_context(engine: Any) -> Iterator[Any]:
    """The engine's fallback active for one forward (yields it), or None when DeepCompile ZeRO-3 is not on."""
    fallback = getattr(engine, "_deepcompile_z3_eager_fallback", None)
    if fallback is None or not engine.is_deepcompile_active() or not engine.zero_optimization_partition_weights():
        yield None
        return
    with fallback.forward_context():
        yield fallback


def _context_depth(param: Any) -> int:
    return getattr(param, CONTEXT_DEPTH_ATTR, 0)


def _gathered(param: Any) -> bool:
    return getattr(param, "ds_status", None) == ZeroParamStatus.AVAILABLE and not getattr(param, "ds_persist", False)


class DeepCompileZ3EagerFallback:
    """Eager gathers of one engine's ZeRO-3 parameters during DeepCompile forwards (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._depth = 0
        self._tracked: dict[int, Any] = {}  # ds_id -> parameter gathered eagerly and not yet released
        self._current: set[int] = set()  # ds_ids read in the running forward
        self._next_graph = 0
        self._outstanding: set[int] = set()  # forwards whose backward has not completed
        self._backward_started: set[int] = set()
        self._graph_claims: dict[int, set[int]] = {}  # forward -> ds_ids it keeps gathered
        self._param_claims: dict[int, set[int]] = {}  # ds_id -> forwards keeping it
        self._deferred_updated: set[int] = set()  # modified under a user's block while a forward held them
        self._user_adopted: set[int] = set()
        self._last: dict[str, list[int]] = {k: [] for k in ("gathered", "released", "guard_suppressed",
                                                               "pre_forward_released", "user_adopted", "completed")}
        self.total_gathered_params = 0

    # ---- the forward ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        global _ACTIVE_FALLBACK
        previous = _ACTIVE_FALLBACK
        self._depth += 1
        if self._depth == 1:
            for key in ("gathered", "guard_suppressed", "pre_forward_released"):
                self._last[key] = []
            self._current.clear()
            self.release_available_params_for_next_forward()
            self._set_in_forward(True)
        _ACTIVE_FALLBACK = self
        try:
            yield
        finally:
            _ACTIVE_FALLBACK = previous
            self._depth -= 1
            if self._depth == 0:
                self._set_in_forward(False)

    def _set_in_forward(self, on: bool) -> None:
        for module in self.engine.module.modules():
            if on:
                ensure_zero_ordered_dict(module)  # the scheduler's tables too: they read through the fallback
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = on

    # ---- records -------------------------------------------------------------------------------------------
    def record_gathered_param(self, param: Any) -> None:
        owner = getattr(param, OWNER_ATTR, None)
        if owner is not None and owner is not self:
            owner._drop(param)
        self._tracked[param.ds_id] = param
        setattr(param, OWNER_ATTR, self)
        self._current.add(param.ds_id)
        self._last["gathered"].append(param.ds_id)
        self.total_gathered_params += 1

    def record_param_access(self, param: Any) -> None:
        """An already gathered parameter read again: the running forward uses it too."""
        if self._tracked.get(param.ds_id) is param:
            self._current.add(param.ds_id)

    def record_guard_suppressed_param(self, param: Any) -> None:
        self._last["guard_suppressed"].append(param.ds_id)

    def record_user_context_claim(self, param: Any) -> None:
        """A user's ``GatheredParameters`` block also holds this parameter (reported once per parameter)."""
        if param.ds_id not in self._user_adopted:
            self._user_adopted.add(param.ds_id)
            self._last["user_adopted"].append(param.ds_id)

    def release_user_context_claim(self, param: Any) -> None:
        """The user's block ended: forget the parameter unless a forward or another block still holds it."""
        if not self._param_claims.get(param.ds_id) and not _context_depth(param):
            self._drop(param)

    def has_outstanding_graph_claim(self, param: Any) -> bool:
        return bool(self._param_claims.get(param.ds_id))

    def record_deferred_user_update(self, param: Any) -> None:
        self._deferred_updated.add(param.ds_id)

    def record_forward_graph(self) -> int:
        """A forward with a backward: what it gathered stays until that backward completes. Returns its id."""
        graph_id = self._next_graph
        self._next_graph += 1
        self._outstanding.add(graph_id)
        self._graph_claims[graph_id] = set(self._current)
        for ds_id in self._current:
            self._param_claims.setdefault(ds_id, set()).add(graph_id)
        return graph_id

    def record_backward_start(self, graph_id: int | None) -> None:
        if graph_id in self._outstanding:
            self._backward_started.add(graph_id)

    # ---- releases ------------------------------------------------------------------------------------------
    def _drop(self, param: Any) -> None:
        ds_id = param.ds_id
        if self._tracked.get(ds_id) is param:
            del self._tracked[ds_id]
        self._current.discard(ds_id)
        for graph_id in self._param_claims.pop(ds_id, set()):
            self._graph_claims.get(graph_id, set()).discard(ds_id)
        self._deferred_updated.discard(ds_id)
        if getattr(param, OWNER_ATTR, None) is self:
            delattr(param, OWNER_ATTR)

    @torch.no_grad()
    def _release_unclaimed(self) -> list[int]:
        released = []
        for ds_id, param in list(self._tracked.items()):
            if self._param_claims.get(ds_id) or _context_depth(param):
                continue
            if _gathered(param):
                if ds_id in self._deferred_updated:
                    param.partition(has_been_updated=True)
                else:
                    param.partition()
                released.append(ds_id)
            self._drop(param)
        return released

    @torch.no_grad()
    def release_available_params_for_next_forward(self) -> None:
        """Before a forward: every gathered parameter no one holds goes back to its partition (the guards and the
        compiled graph expect released parameters)."""
        released = self._release_unclaimed()
        if not self._outstanding and self.engine is not None:
            for param in self.engine.module.parameters():
                if hasattr(param, "ds_status") and _gathered(param) and not _context_depth(param):
                    param.partition()
                    released.append(param.ds_id)
        self._last["pre_forward_released"] = released

    def complete_backward(self) -> None:
        """The backward of every forward it reached is done: their claims end and unclaimed gathers go."""
        done = sorted(self._backward_started)
        if not done:
            return
        self._backward_started.clear()
        self._outstanding.difference_update(done)
        for graph_id in done:
            for ds_id in self._graph_claims.pop(graph_id, set()):
                claims = self._param_claims.get(ds_id)
                if claims is not None:
                    claims.discard(graph_id)
                    if not claims:
                        del self._param_claims[ds_id]
        self._last["completed"] = done
        self._last["released"] = self._release_unclaimed()

    def release_gathered_params(self) -> None:
        """Forwards whose backward will never run (abandoned): release everything they held."""
        self._outstanding.clear()
        self._backward_started.clear()
        self._graph_claims.clear()
        self._param_claims.clear()
        self._last["released"] = self._release_unclaimed()

    def stats(self) -> dict[str, Any]:
        return {
            "tracked_param_ids": sorted(self._tracked),
            "last_gathered_param_ids": list(self._last["gathered"]),
            "last_released_param_ids": list(self._last["released"]),
            "last_guard_suppressed_param_ids": list(self._last["guard_suppressed"]),
            "last_pre_forward_released_param_ids": list(self._last["pre_forward_released"]),
            "last_user_adopted_param_ids": list(self._last["user_adopted"]),
            "current_forward_param_ids": sorted(self._current),
            "outstanding_forward_graph_ids": sorted(self._outstanding),
            "backward_started_forward_graph_ids": sorted(self._backward_started),
            "graph_claim_param_ids": {g: sorted(ids) for g, ids in sorted(self._graph_claims.items())},
            "param_graph_claim_ids": {d: sorted(gs) for d, gs in sorted(self._param_claims.items())},
            "context_claimed_param_ids": sorted(d for d, p in self._tracked.items() if _context_depth(p)),
            "deferred_updated_param_ids": sorted(self._deferred_updated),
            "last_completed_forward_graph_ids": list(self._last["completed"]),
            "total_gathered_params": self.total_gathered_params,
        }


# the parameter tables (ds_zero) find the active tracker and the guard test through these, looked up at each read
parameter_offload.eager_fallback_hooks = (lambda: _ACTIVE_FALLBACK, lambda: is_dynamo_guard_evaluation())

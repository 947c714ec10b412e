"""``engine.no_sync()`` and ``engine.coalesce_grad_reduction()``: backward calls whose gradient reduction is
skipped (gradients accumulate locally) or deferred to one reduction at the block's end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from deepspeed.runtime.engine import _unmanaged


class GradSyncContextError(RuntimeError, AssertionError):
    """Misuse of ``no_sync`` / ``coalesce_grad_reduction`` (a step inside, one opened inside the other): DeepSpeed
    asserts there, so code catching its ``AssertionError`` still catches this."""


class GradSyncMethods:
    """Mixin for ``DeepSpeedEngine``: requires ``reducer``, ``optimizer``, ``_sync_enabled`` (cleared inside
    ``no_sync``), ``pipeline_parallelism`` and the ZeRO stage accessors."""

    reducer: Any
    _sync_enabled: bool
    pipeline_parallelism: bool
    zero_optimization_stage: Any
    zero_optimization_partition_gradients: Any

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the gradient all-reduce inside the block (gradients accumulate locally)."""
        if self.zero_optimization_partition_gradients():  # DeepSpeed's documented error type and wording
            raise AssertionError("no_sync context manager is incompatible with gradient partitioning logic of ZeRO "
                                 f"stage {self.zero_optimization_stage()}; use coalesce_grad_reduction()")
        if not self._sync_enabled:
            raise AssertionError("no_sync context manager reentry is unsupported")
        if getattr(self.reducer, "coalescing", False):
            raise GradSyncContextError("no_sync context manager cannot open inside coalesce_grad_reduction()")
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """One gradient reduction for several backward calls (ZeRO stages 1-3; the reducer provides it)."""
        if self.zero_optimization_stage() == 0:
            raise NotImplementedError("coalesce_grad_reduction is not supported with ZeRO stage 0 (as documented); "
                                      "use no_sync() to skip reductions")
        _unmanaged.refuse(self, "coalesce_grad_reduction")
        if self.pipeline_parallelism:
            raise NotImplementedError("coalesce_grad_reduction is not supported with pipeline parallelism: the "
                                      "pipeline schedule runs the backward passes and their reductions itself")
        if not self._sync_enabled:
            raise GradSyncContextError("coalesce_grad_reduction cannot be nested inside no_sync()")
        hold = getattr(self.reducer, "hold", None)
        if self.zero_optimization_stage() == 3 and hold is not None:
            with hold():  # the backward calls inside only fill the reduce-scatter buckets
                yield
            self._flush_coalesced_reduction_zero3(self.optimizer)
            return
        coalesce = getattr(self.reducer, "coalesce", None)
        if coalesce is None:
            raise TypeError(f"the ZeRO stage {self.zero_optimization_stage()} reducer "
                            f"({type(self.reducer).__name__}) has no coalesce()")
        with coalesce():
            yield

    def _flush_coalesced_reduction_zero3(self, optimizer: Any) -> None:
        """The one reduce-scatter pass of a ``coalesce_grad_reduction()`` block under ZeRO-3: every bucket the
        block's backward calls filled goes out and its average lands in the gradient partitions. It runs before
        any other reduction of the window (``optimizer.micro_step_id`` is 0), so the partitions hold exactly it."""
        optimizer.reducer.finish()


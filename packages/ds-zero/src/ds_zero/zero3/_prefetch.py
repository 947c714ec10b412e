"""Prefetch by a recorded trace: the order in which gather units were fetched during the last complete pass
(forward, and backward when there was one) predicts the next pass.

While a pass replays the trace, fetching the unit at position ``i`` lets the scheduler walk the trace ahead
(``Lookahead``: each position once per pass, as DeepSpeed's fetch queue) and start the gathers of what is not
gathered yet, up to ``prefetch_bucket_size`` elements of gathers and never past ``max_live_parameters``
gathered elements. A parameter the walk passes while it is gathered already (or on its way) stays gathered until
that later use instead of being released and gathered again, as DeepSpeed keeps what its prefetch skipped; and a
unit whose next use is fewer than ``max_reuse_distance`` elements away is kept rather than released. A pass
that fetches another unit than the trace predicts (a dynamic model, an eval pass after a training pass) stops
prefetching, and keeping, for the rest of the pass; the trace is then rebuilt from what that pass did.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TraceSettings:
    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000


@dataclass
class Trace:
    """Unit ids in fetch order, their sizes (elements not persistent), and per position the next position of
    the same unit."""

    units: list[int] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    _next_use: list[int] = field(default_factory=list)
    _prefix: list[int] = field(default_factory=list)

    def freeze(self) -> None:
        last: dict[int, int] = {}
        self._next_use = [len(self.units)] * len(self.units)
        for i in range(len(self.units) - 1, -1, -1):
            self._next_use[i] = last.get(self.units[i], len(self.units))
            last[self.units[i]] = i
        self._prefix = [0]
        for n in self.numels:
            self._prefix.append(self._prefix[-1] + n)

    def reuse_distance(self, position: int) -> int | None:
        """Elements fetched between ``position`` and the next use of the same unit, or None if never reused."""
        nxt = self._next_use[position]
        if nxt >= len(self.units):
            return None
        return self._prefix[nxt] - self._prefix[position + 1]

    def ahead(self, position: int, numel_budget: int) -> list[int]:
        """Positions after ``position`` up to the one that reaches ``numel_budget`` elements."""
        out, total = [], 0
        for j in range(position + 1, len(self.units)):
            if total >= numel_budget:
                break
            out.append(j)
            total += self.numels[j]
        return out


class TraceCache:
    """The trace of the last complete pass, and the one being recorded."""

    def __init__(self) -> None:
        self.trace: Trace | None = None
        self.recording = Trace()
        self.on_track = True
        self.rebuilt = 0

    @property
    def position(self) -> int:
        return len(self.recording.units) - 1

    def record(self, unit_id: int, numel: int) -> bool:
        """Record a fetch; True while the pass still follows the trace (so prefetch and reuse may use it)."""
        pos = len(self.recording.units)
        self.recording.units.append(unit_id)
        self.recording.numels.append(numel)
        if self.trace is None:
            self.on_track = False
        elif self.on_track and (pos >= len(self.trace.units) or self.trace.units[pos] != unit_id):
            self.on_track = False
        return self.on_track

    def end_pass(self) -> bool:
        """Close the pass; True when its order differed from the trace (which is then replaced)."""
        changed = self.trace is None or self.recording.units != self.trace.units
        if changed and self.recording.units:
            self.recording.freeze()
            self.trace = self.recording
            self.rebuilt += 1
        self.recording = Trace()
        self.on_track = self.trace is not None
        return changed and self.rebuilt > 1


class Lookahead:
    """The prefetch walk of one pass: the next trace position to visit, and per parameter (``ds_id``) the last
    position the walk passed it at. A parameter passed at a position after the running one is still wanted there:
    the scheduler does not release it before then."""

    def __init__(self) -> None:
        self.next = 0
        self.keep_until: dict[int, int] = {}

    def passed(self, ds_id: int, position: int) -> None:
        if self.keep_until.get(ds_id, -1) < position:
            self.keep_until[ds_id] = position

    def kept(self, ds_id: int, position: int) -> bool:
        """True while ``ds_id`` has a use the walk passed after ``position``."""
        return self.keep_until.get(ds_id, -1) > position

    def reset(self) -> None:
        self.next = 0
        self.keep_until.clear()

"""A worker thread: takes chunks from its queue and keeps up to ``queue_depth`` of their blocks in flight.

Consecutive chunks that use the same ring are pipelined (the next op's blocks enter the queue while the
previous op's last blocks are still in flight), so many small async requests overlap too.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass

from ds_ops.aio._errors import AioError
from ds_ops.aio._ops import Block, Chunk, Staging, complete_block
from ds_ops.aio._rings import LibaioRing, ThreadRing


@dataclass(frozen=True)
class Settings:
    """Scheduling knobs of a handle (see ``AsyncIOHandle``)."""

    block_size: int
    queue_depth: int
    single_submit: bool
    overlap_events: bool


_STOP = object()


class Worker:
    """One I/O thread with its own rings. ``libaio``: the thread's io context, or None for the fallback."""

    def __init__(self, index: int, settings: Settings, libaio: LibaioRing | None) -> None:
        self.settings = settings
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._rings: dict[str, LibaioRing | ThreadRing] = {}
        if libaio is not None:
            self._rings["libaio"] = libaio
        self._deferred: Chunk | None = None
        self._stopping = False
        self._staging: Staging | None = None
        self._open: list[Chunk] = []
        self._thread = threading.Thread(target=self._main, name=f"ds-aio-worker-{index}", daemon=True)
        self._thread.start()

    def _ring(self, kind: str) -> LibaioRing | ThreadRing:
        ring = self._rings.get(kind)
        if ring is None:
            depth = self.settings.queue_depth
            ring = self._rings[kind] = LibaioRing(depth) if kind == "libaio" else ThreadRing(depth)
        return ring

    def _stage(self) -> Staging:
        """The worker's aligned staging blocks, allocated the first time a misaligned buffer needs them."""
        if self._staging is None:
            self._staging = Staging(2 * self.settings.queue_depth, self.settings.block_size)  # see _serve_ring
        return self._staging

    def stop(self) -> None:
        """Finish every queued chunk, then end the thread and release the rings (io contexts, threads)."""
        self.jobs.put(_STOP)
        self._thread.join()
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()
        self._staging = None

    def _main(self) -> None:
        while not self._stopping or self._deferred is not None:
            chunk, self._deferred = self._deferred, None
            if chunk is None:
                item = self.jobs.get()
                if item is _STOP:
                    return
                chunk = item
            self._serve(chunk)

    def _pull(self, kind: str) -> Chunk | None:
        """A queued chunk for ring ``kind`` without blocking; one for another ring waits for the next round."""
        if self._stopping or self._deferred is not None:
            return None
        try:
            item = self.jobs.get_nowait()
        except queue.Empty:
            return None
        if item is _STOP:
            self._stopping = True
            return None
        if item.ring_kind != kind:
            self._deferred = item
            return None
        return item

    def _serve(self, first: Chunk) -> None:
        self._open = [first]
        try:
            self._serve_ring(first)
        except Exception as exc:  # a broken ring (io_getevents failing) must not leave callers waiting forever
            broken = self._rings.pop(first.ring_kind, None)
            if broken is not None:
                broken.close()  # waits for its requests: their buffers and files stay valid until then
            self._staging = None  # slots of abandoned pieces were never handed back
            for chunk in self._open:
                chunk.op.fail(AioError(chunk.op.operation, chunk.op.target.path, None, f"I/O worker failed: {exc!r}"))
                chunk.op.chunk_done()
            self._open = []

    def _serve_ring(self, first: Chunk) -> None:
        s = self.settings
        ring = self._ring(first.ring_kind)
        handing_out: deque[Chunk] = deque([first])  # chunks with blocks not yet submitted
        open_chunks = self._open  # chunks not yet finished
        copy_outs: list[tuple[Block, bool]] = []  # staged pieces reaped but not yet handed back
        inflight = 0
        while True:
            ready = self._fill(handing_out, open_chunks, s.queue_depth - inflight, first.ring_kind)
            if ready:
                ring.submit(ready, s.single_submit)
                inflight += len(ready)
            # Staged reads are copied out to the tensor only now, while the pieces just queued are in flight.
            for block, ok in copy_outs:
                self._staging.give_back(block, ok)
            copy_outs.clear()
            open_chunks[:] = self._retire(open_chunks)
            if not open_chunks:
                return
            if inflight:
                for block, res in ring.reap(1 if s.overlap_events else inflight):
                    inflight -= 1
                    ok = complete_block(block, res)
                    if block.stage is not None:
                        copy_outs.append((block, ok))

    def _fill(self, handing_out: deque[Chunk], open_chunks: list[Chunk], room: int, kind: str) -> list[Block]:
        """Up to ``room`` next pieces, pulling queued chunks for the same ring when the current ones run out."""
        ready: list[Block] = []
        while len(ready) < room:
            block = handing_out[0].next_block(self.settings.block_size, self._stage) if handing_out else None
            if block is not None:
                ready.append(block)
                continue
            if handing_out:
                handing_out.popleft()
                continue
            nxt = self._pull(kind)
            if nxt is None:
                break
            handing_out.append(nxt)
            open_chunks.append(nxt)
        return ready

    @staticmethod
    def _retire(chunks: list[Chunk]) -> list[Chunk]:
        still = []
        for chunk in chunks:
            if chunk.finished:
                chunk.op.chunk_done()
            else:
                still.append(chunk)
        return still

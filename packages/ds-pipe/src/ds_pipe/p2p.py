"""Point-to-point exchange between neighbouring pipeline stages: activations forward, gradients backward.

Each direction of a link is a stream of messages whose sizes the receiver always knows in advance, so it never
blocks on a buffer of the wrong size, and a stage that fails can always send its neighbour a message of exactly
the size the neighbour waits for (see ``docs/pipeline-p2p.md``):

- a *frame* carries one activation (a tensor or a tuple of tensors) or one set of gradients in a single byte
  buffer: every tensor's bytes (64-byte aligned), then a 16-byte trailer (two int64: a code and an argument,
  written as bytes, so they are exact whatever the payload's dtype). The trailer is ``OK``, or ``ABORT`` with the
  length of a UTF-8 message that follows in one more message.
- a *control* message (two int64: ``SAME``, ``NEW`` with the length of an encoded layout that follows, or
  ``ABORT`` with the length of its message) comes before the first frame of each direction (at the start, and
  after ``reset_shapes``), and before every frame with ``dynamic_shape``. With static shapes a step therefore
  sends one message per activation and one per gradient, as many as DeepSpeed's pipeline sends.

Both ends derive the size of the next message of a direction from what has travelled in it so far (the layout of
the activations, the gradients' shapes being those of the activations that need them), so the sender of an
``ABORT`` knows what its neighbour expects: a control message if one is due, else a frame of the current size.
The receiver raises :class:`PipelineAbort` with the failing stage's message, and the engine passes it on, so every
stage of the pipeline fails with the cause instead of hanging (activations whose shape changed without
``dynamic_shape``: :class:`PipelineShapeError`, a data iterator that ran dry, any exception in a stage's schedule).

Sends do not block: a stage goes on computing while its neighbour receives (``flush`` waits for them at the end of
a batch), and a stage whose neighbour failed is never stuck in a send: its next receive from that neighbour reads
the ``ABORT``. ``bool`` tensors travel as bytes (NCCL has no bool). With a tensor-parallel ``slice_group`` of more
than one rank and partitioning on (the ``pipeline.pipe_partitioned`` / ``grad_partitioned`` settings), each slice
rank sends only its 1/n share of every floating-point tensor and the receivers all-gather the shares within their
slice group: the activations of tensor-parallel ranks are identical, so the link carries each byte once.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_SAME, _NEW, _ABORT = 0, 1, 2  # control codes; a frame's trailer holds _SAME (all well) or _ABORT
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_ABORT_WAIT_S = 5.0
_ALIGN = 64  # each tensor of a frame starts 64-byte aligned, as a tensor of its own would
TRAILER_BYTES = 16
_MAX_MESSAGE = 1 << 16


class PipelineAbort(RuntimeError):
    """Another stage of the pipeline failed; the message is its error (this stage cannot go on without it)."""

    def __init__(self, message: str, from_rank: int) -> None:
        super().__init__(message)
        self.from_rank = from_rank

    def __reduce__(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        # multiprocessing re-raises a worker's error in the parent by unpickling it: rebuild through this
        # __init__ (an unpicklable exception kills the pool's result thread and the parent waits forever)
        return type(self), (str(self), self.from_rank), dict(self.__dict__)


class PipelineShapeError(RuntimeError):
    """A stage's activations changed shape after the first micro-batch without ``dynamic_shape``."""


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver must know to allocate one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool

    def describe(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}" + (" (grad)" if self.requires_grad
                                                                                   else "")


@dataclass(frozen=True)
class Layout:
    """The layout of one message: its tensors, and whether it was a single tensor rather than a tuple."""

    tensors: tuple[TensorMeta, ...]
    single: bool

    @staticmethod
    def of(value: torch.Tensor | Sequence[torch.Tensor]) -> Layout:
        single = isinstance(value, torch.Tensor)
        tensors = (value,) if single else tuple(value)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"a pipeline stage can only pass tensors or tuples of tensors to the next stage; "
                                f"element {i} is a {type(t).__name__}")
            if t.dtype not in _DTYPES:
                raise TypeError(f"a pipeline stage cannot send a tensor of dtype {t.dtype} (element {i}); accepted: "
                                f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
        return Layout(tuple(TensorMeta(t.dtype, tuple(t.shape), bool(t.requires_grad)) for t in tensors), single)

    def describe(self) -> str:
        return "[" + ", ".join(m.describe() for m in self.tensors) + "]"

    def encode(self) -> list[int]:
        out = [int(self.single), len(self.tensors)]
        for m in self.tensors:
            out += [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
        return out

    @staticmethod
    def decode(values: list[int]) -> Layout:
        single, count, pos, tensors = bool(values[0]), values[1], 2, []
        for _ in range(count):
            dtype, grad, ndim = _DTYPES[values[pos]], bool(values[pos + 1]), values[pos + 2]
            tensors.append(TensorMeta(dtype, tuple(values[pos + 3:pos + 3 + ndim]), grad))
            pos += 3 + ndim
        return Layout(tuple(tensors), single)

    def key(self) -> tuple[Any, ...]:
        return (self.single, *((m.dtype, m.shape, m.requires_grad) for m in self.tensors))


def _key_of(value: Any) -> tuple[Any, ...] | None:
    """``Layout.of(value).key()`` without building the layout (the per-message check); None: not tensors."""
    try:
        if isinstance(value, torch.Tensor):
            return (True, (value.dtype, tuple(value.shape), value.requires_grad))
        return (False, *((t.dtype, tuple(t.shape), t.requires_grad) for t in value))
    except (AttributeError, TypeError):
        return None


@dataclass(frozen=True)
class _Slot:
    """Where one tensor lies in a frame."""

    offset: int  # bytes from the frame's start
    numel: int  # elements in this frame: the tensor's, or this slice rank's share of it
    wire: torch.dtype  # the dtype it travels as (bool as uint8)
    meta: TensorMeta
    split: bool


@dataclass(frozen=True)
class Frame:
    """The byte layout of one frame: the tensors' slots, then the trailer at ``tail``."""

    slots: tuple[_Slot, ...]
    tail: int

    @property
    def nbytes(self) -> int:
        return self.tail + TRAILER_BYTES

    @staticmethod
    def plan(metas: Sequence[TensorMeta], slices: int = 1, split: bool = False) -> Frame:
        """The frame of ``metas``; with ``split``, each floating-point tensor's 1/``slices`` share (padded)."""
        slots, end = [], 0
        for meta in metas:
            wire = torch.uint8 if meta.dtype == torch.bool else meta.dtype
            numel = _numel(meta.shape)
            cut = split and slices > 1 and meta.dtype.is_floating_point and numel > 0
            share = -(-numel // slices) if cut else numel
            offset = _round_up(end, _ALIGN)
            slots.append(_Slot(offset, share, wire, meta, cut))
            end = offset + share * wire.itemsize
        return Frame(tuple(slots), _round_up(end, 8))


@dataclass(frozen=True)
class LinkConfig:
    """Who this link connects and how it sends (see the module docstring). ``partitioned``: split activations
    over the slice group; ``grad_partitioned``: split gradients (None: as ``partitioned``)."""

    stage: int
    peer_stage: int
    peer_rank: int
    device: torch.device
    dynamic_shape: bool = False
    slice_group: Any = None
    partitioned: bool = False
    grad_partitioned: bool | None = None


class StageLink:
    """This stage's end of the link to one neighbouring stage (both directions): to a later stage it sends
    activations and receives their gradients, to an earlier one the reverse."""

    def __init__(self, config: LinkConfig) -> None:
        self.config = config
        self._pending: list[Any] = []  # sends in flight (their buffers stay referenced until they complete)
        self._slices = dist.get_world_size(config.slice_group) if config.slice_group is not None else 1
        self._slice_rank = dist.get_rank(config.slice_group) if config.slice_group is not None else 0
        grads_split = config.partitioned if config.grad_partitioned is None else config.grad_partitioned
        self._split = {"activations": config.partitioned and self._slices > 1,
                       "gradients": grads_split and self._slices > 1}
        self.reset_shapes()

    def flush(self) -> None:
        """Wait until every send of this link has been received."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def reset_shapes(self) -> None:
        """Forget the layouts exchanged so far: each direction starts again with a control message (both stages
        must call it at the same point, between batches)."""
        self._sent: Layout | None = None  # activations: the layout sent (to a later stage) and its frame
        self._sent_key: tuple[Any, ...] | None = None
        self._sent_frame: Frame | None = None
        self._received: Layout | None = None  # activations: the layout received (from an earlier stage)
        self._received_frame: Frame | None = None
        self._grads_sent = self._grads_received = False  # has a gradient frame travelled since the reset?
        self._grad_frames: dict[tuple[Any, ...], Frame] = {}

    # ---- activations: layout once (each time with dynamic_shape), then frames --------------------------------
    def send(self, value: torch.Tensor | Sequence[torch.Tensor], what: str = "activations") -> None:
        tensors = (value,) if isinstance(value, torch.Tensor) else tuple(value)
        key = _key_of(value)
        if key is None or key != self._sent_key:
            layout = Layout.of(value)  # raises for what cannot travel
            if self._sent is not None and not self.config.dynamic_shape:
                raise PipelineShapeError(self._shape_change_message(layout, what))
            frame = Frame.plan(layout.tensors, self._slices, self._split["activations"])
            buf = self._pack(frame, tensors)
            control = layout.encode()
            # the state changes only once nothing can fail before the sends: an abort is shaped by it
            self._sent, self._sent_key, self._sent_frame = layout, layout.key(), frame
        else:
            buf = self._pack(self._sent_frame, tensors)
            control = [] if self.config.dynamic_shape else None
        if control is not None:
            self._isend(torch.tensor([_NEW if control else _SAME, len(control)], dtype=torch.int64))
            if control:
                self._isend(torch.tensor(control, dtype=torch.int64))
        self._isend(buf)

    def recv(self, what: str = "activations") -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self._received is None or self.config.dynamic_shape:
            code, length = self._recv_control(what)
            if code == _NEW:
                values = torch.empty(length, dtype=torch.int64, device=self.config.device)
                dist.recv(values, self.config.peer_rank)
                self._received = Layout.decode(values.tolist())
                self._received_frame = Frame.plan(self._received.tensors, self._slices, self._split["activations"])
            elif self._received is None:
                raise RuntimeError(f"pipeline stage {self.config.stage}: stage {self.config.peer_stage} sent {what} "
                                   "without a layout first (the two stages run different pipeline code?)")
        out = self._recv_frame(self._received_frame, what)
        for t, meta in zip(out, self._received.tensors, strict=True):
            t.requires_grad_(meta.requires_grad)
        return out[0] if self._received.single else tuple(out)

    # ---- gradients: shapes known from the activations they belong to ----------------------------------------
    def send_grads(self, grads: Sequence[torch.Tensor]) -> None:
        buf = self._pack(self._grad_frame([(g.dtype, tuple(g.shape)) for g in grads]), grads)
        if not self._grads_sent or self.config.dynamic_shape:
            self._isend(torch.tensor([_SAME, 0], dtype=torch.int64))
            self._grads_sent = True
        self._isend(buf)

    def recv_grads(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not self._grads_received or self.config.dynamic_shape:
            self._recv_control("gradients")
            self._grads_received = True
        return self._recv_frame(self._grad_frame([(t.dtype, tuple(t.shape)) for t in like]), "gradients")

    # ---- failure ---------------------------------------------------------------------------------------------
    def abort(self, message: str) -> None:
        """Tell the neighbour this stage failed (best effort: it may have failed or left already): an ``ABORT``
        shaped as the next message the neighbour expects from this stage, then the message."""
        text = (message or "(no message)").encode("utf-8")[:_MAX_MESSAGE]
        head = self._abort_head(len(text))
        try:
            works = [self._isend(head), self._isend(torch.frombuffer(bytearray(text), dtype=torch.uint8))]
            for work in works:
                work.wait(timeout=datetime.timedelta(seconds=_ABORT_WAIT_S))
        except Exception:  # noqa: BLE001 - the neighbour is gone: its own error already tells the story
            pass

    def _abort_head(self, length: int) -> torch.Tensor:
        if self.config.peer_stage > self.config.stage:  # this direction carries activations
            frame = None if self._sent is None or self.config.dynamic_shape else self._sent_frame
        elif self._grads_sent and not self.config.dynamic_shape:  # gradients; their shapes: the activations'
            frame = self._grad_frame([(m.dtype, m.shape) for m in self._received.tensors if m.requires_grad])
        else:
            frame = None
        if frame is None:
            return torch.tensor([_ABORT, length], dtype=torch.int64)
        buf = torch.zeros(frame.nbytes, dtype=torch.uint8, device=self.config.device)
        buf[frame.tail:].view(torch.int64).copy_(torch.tensor([_ABORT, length], dtype=torch.int64))
        return buf

    # ---- wire ------------------------------------------------------------------------------------------------
    def _grad_frame(self, shapes: list[tuple[torch.dtype, tuple[int, ...]]]) -> Frame:
        key = tuple(shapes)
        frame = self._grad_frames.get(key)
        if frame is None:
            if len(self._grad_frames) >= 64:  # dynamic shapes: keep the recent ones
                self._grad_frames.clear()
            metas = [TensorMeta(dtype, shape, False) for dtype, shape in shapes]
            frame = self._grad_frames[key] = Frame.plan(metas, self._slices, self._split["gradients"])
        return frame

    def _pack(self, frame: Frame, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        buf = torch.empty(frame.nbytes, dtype=torch.uint8, device=self.config.device)
        for slot, t in zip(frame.slots, tensors, strict=True):
            src = t.detach()
            if src.dtype == torch.bool:
                src = src.view(torch.uint8)
            dst = buf[slot.offset:slot.offset + slot.numel * slot.wire.itemsize].view(slot.wire)
            if slot.split:
                dst.copy_(_padded(src.reshape(-1), self._slices).chunk(self._slices)[self._slice_rank])
            else:
                dst.view(src.shape).copy_(src)
        buf[frame.tail:].zero_()  # trailer: _SAME, 0
        return buf

    def _recv_frame(self, frame: Frame, what: str) -> list[torch.Tensor]:
        buf = torch.empty(frame.nbytes, dtype=torch.uint8, device=self.config.device)
        dist.recv(buf, self.config.peer_rank)
        code, length = buf[frame.tail:].view(torch.int64).tolist()
        if code != _SAME:
            self._raise_abort(code, length, what)
        out = []
        for slot in frame.slots:
            part = buf[slot.offset:slot.offset + slot.numel * slot.wire.itemsize].view(slot.wire)
            if slot.split:
                whole = torch.empty(slot.numel * self._slices, dtype=slot.wire, device=self.config.device)
                dist.all_gather_into_tensor(whole, part, group=self.config.slice_group)
                part = whole[:_numel(slot.meta.shape)]
            if slot.meta.dtype == torch.bool:
                part = part.view(torch.bool)
            out.append(part.view(slot.meta.shape))
        return out

    def _recv_control(self, what: str) -> tuple[int, int]:
        header = torch.empty(2, dtype=torch.int64, device=self.config.device)
        dist.recv(header, self.config.peer_rank)
        code, length = header.tolist()
        if code not in (_SAME, _NEW):
            self._raise_abort(code, length, what)
        return code, length

    def _raise_abort(self, code: int, length: int, what: str) -> None:
        if code != _ABORT or not 0 < length <= _MAX_MESSAGE:
            raise RuntimeError(f"pipeline stage {self.config.stage}: unreadable message (code {code}) from stage "
                               f"{self.config.peer_stage} while receiving {what} (the two stages run different "
                               "pipeline code, or called reset_activation_shape at different points?)")
        data = torch.empty(length, dtype=torch.uint8, device=self.config.device)
        dist.recv(data, self.config.peer_rank)
        raise PipelineAbort(bytes(data.cpu().tolist()).decode("utf-8", errors="replace"), self.config.peer_rank)

    def _isend(self, tensor: torch.Tensor) -> Any:
        # completed sends let go of their buffers
        self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]
        tensor = tensor.to(self.config.device)
        work = dist.isend(tensor, self.config.peer_rank)
        self._pending.append((work, tensor))
        return work

    def _shape_change_message(self, layout: Layout, what: str) -> str:
        c = self.config
        return (f"pipeline stage {c.stage} -> stage {c.peer_stage}: the {what} changed from "
                f"{self._sent.describe()} to {layout.describe()} after the first micro-batch; stage {c.peer_stage} "
                f"expects {self._sent.describe()}. Shapes are exchanged once; pass dynamic_shape=True to "
                "PipelineModule when they change between micro-batches")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _padded(flat: torch.Tensor, parts: int) -> torch.Tensor:
    extra = -flat.numel() % parts
    return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat

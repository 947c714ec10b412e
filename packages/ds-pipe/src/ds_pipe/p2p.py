"""Point-to-point exchange between neighbouring pipeline stages: activations forward, gradients backward.

A stage sends a tensor or a tuple of tensors. Every message starts with a two-int header, so the receiver can
never block on a buffer of the wrong size:

- ``SAME``: the layout (count, dtypes, shapes, ``requires_grad`` flags) is the one sent before; the tensors follow.
- ``NEW``: a layout follows (once, on the first send, and whenever it changes under ``dynamic_shape``), then the
  tensors.
- ``ABORT`` (:meth:`StageLink.abort`): a UTF-8 message follows. The sender failed (activations whose shape changed
  without ``dynamic_shape``: :class:`PipelineShapeError`, a data iterator that ran dry, any exception in its
  schedule); the receiver raises :class:`PipelineAbort` with that message, and the engine passes it on, so every
  stage of the pipeline fails with the cause instead of hanging.

Sends do not block: a stage goes on computing while its neighbour receives (``flush`` waits for them at the end of
a batch), and a stage whose neighbour failed is never stuck in a send: its next receive from that neighbour reads
the ``ABORT``. Gradients travel without a layout: the receiving stage knows the shapes of the outputs it sent.
``bool`` tensors travel as ``uint8`` (NCCL has no bool). With a tensor-parallel ``slice_group`` of more than one
rank and ``partitioned=True`` (the ``pipeline.pipe_partitioned`` / ``grad_partitioned`` settings), each slice rank sends
only its 1/n share of every floating-point tensor and the receivers all-gather the shares within their slice
group: the activations of tensor-parallel ranks are identical, so the link carries each byte once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_SAME, _NEW, _ABORT = 0, 1, 2
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_ABORT_WAIT_S = 5.0


class PipelineAbort(RuntimeError):
    """Another stage of the pipeline failed; the message is its error (this stage cannot go on without it)."""

    def __init__(self, message: str, from_rank: int) -> None:
        super().__init__(message)
        self.from_rank = from_rank


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


@dataclass(frozen=True)
class LinkConfig:
    """Who this link connects and how it sends (see the module docstring)."""

    stage: int
    peer_stage: int
    peer_rank: int
    device: torch.device
    dynamic_shape: bool = False
    slice_group: Any = None
    partitioned: bool = False


class StageLink:
    """This stage's end of the link to one neighbouring stage (both directions)."""

    def __init__(self, config: LinkConfig) -> None:
        self.config = config
        self._sent: Layout | None = None
        self._received: Layout | None = None
        self._pending: list[Any] = []  # sends in flight (their tensors stay referenced until they complete)
        self._slices = dist.get_world_size(config.slice_group) if config.slice_group is not None else 1
        self._slice_rank = dist.get_rank(config.slice_group) if config.slice_group is not None else 0

    def flush(self) -> None:
        """Wait until every send of this link has been received."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def reset_shapes(self) -> None:
        """Forget the layouts exchanged so far: the next send carries its layout again."""
        self._sent = self._received = None

    # ---- activations: layout once, then the tensors ---------------------------------------------------------
    def send(self, value: torch.Tensor | Sequence[torch.Tensor], what: str = "activations") -> None:
        layout = Layout.of(value)
        tensors = (value,) if layout.single else tuple(value)
        if self._sent is None or layout != self._sent:
            if self._sent is not None and not self.config.dynamic_shape:
                raise PipelineShapeError(self._shape_change_message(layout, what))
            self._header(_NEW, layout.encode())
            self._sent = layout
        else:
            self._header(_SAME, [])
        for t in tensors:
            self._send_tensor(t)

    def recv(self, what: str = "activations") -> torch.Tensor | tuple[torch.Tensor, ...]:
        code, payload = self._read_header(what)
        if code == _NEW:
            self._received = Layout.decode(payload)
        elif self._received is None:
            raise RuntimeError(f"pipeline stage {self.config.stage}: stage {self.config.peer_stage} sent {what} "
                               "without a layout first (the two stages run different pipeline code?)")
        out = tuple(self._recv_tensor(m).requires_grad_(m.requires_grad) for m in self._received.tensors)
        return out[0] if self._received.single else out

    # ---- gradients: shapes known from the activations they belong to ----------------------------------------
    def send_grads(self, grads: Sequence[torch.Tensor]) -> None:
        self._header(_SAME, [])
        for g in grads:
            self._send_tensor(g)

    def recv_grads(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self._read_header("gradients")
        return [self._recv_tensor(TensorMeta(t.dtype, tuple(t.shape), False)) for t in like]

    # ---- failure ---------------------------------------------------------------------------------------------
    def abort(self, message: str) -> None:
        """Tell the neighbour this stage failed (best effort: it may have failed or left already)."""
        data = torch.tensor(list(message.encode("utf-8")), dtype=torch.uint8)
        header = torch.tensor([_ABORT, data.numel()], dtype=torch.int64)
        try:
            works = [dist.isend(header.to(self.config.device), self.config.peer_rank),
                     dist.isend(data.to(self.config.device), self.config.peer_rank)]
            for work in works:
                work.wait(timeout=_timedelta(_ABORT_WAIT_S))
        except Exception:  # noqa: BLE001 - the neighbour is gone: its own error already tells the story
            pass

    # ---- wire ------------------------------------------------------------------------------------------------
    def _header(self, code: int, payload: list[int]) -> None:
        self._isend(torch.tensor([code, len(payload)], dtype=torch.int64, device=self.config.device))
        if payload:
            self._isend(torch.tensor(payload, dtype=torch.int64, device=self.config.device))

    def _isend(self, tensor: torch.Tensor) -> None:
        # completed sends let go of their tensors: a sent activation must not outlive its backward pass
        self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]
        self._pending.append((dist.isend(tensor, self.config.peer_rank), tensor))

    def _read_header(self, what: str) -> tuple[int, list[int]]:
        header = torch.empty(2, dtype=torch.int64, device=self.config.device)
        dist.recv(header, self.config.peer_rank)
        code, length = (int(v) for v in header.tolist())
        if code == _ABORT:
            data = torch.empty(length, dtype=torch.uint8, device=self.config.device)
            dist.recv(data, self.config.peer_rank)
            message = bytes(data.cpu().tolist()).decode("utf-8", errors="replace")
            raise PipelineAbort(message, self.config.peer_rank)
        payload: list[int] = []
        if length:
            values = torch.empty(length, dtype=torch.int64, device=self.config.device)
            dist.recv(values, self.config.peer_rank)
            payload = values.tolist()
        if code not in (_SAME, _NEW):
            raise RuntimeError(f"pipeline stage {self.config.stage}: unreadable header {code} from stage "
                               f"{self.config.peer_stage} while receiving {what}")
        return code, payload

    def _split(self, dtype: torch.dtype, numel: int) -> bool:
        return self.config.partitioned and self._slices > 1 and dtype.is_floating_point and numel > 0

    def _send_tensor(self, t: torch.Tensor) -> None:
        flat = t.detach().reshape(-1)
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        if self._split(t.dtype, t.numel()):
            flat = _padded(flat, self._slices).chunk(self._slices)[self._slice_rank]
        self._isend(flat.contiguous().to(self.config.device))

    def _recv_tensor(self, meta: TensorMeta) -> torch.Tensor:
        dtype = torch.uint8 if meta.dtype == torch.bool else meta.dtype
        numel = _numel(meta.shape)
        if self._split(meta.dtype, numel):
            share = -(-numel // self._slices)
            part = torch.empty(share, dtype=dtype, device=self.config.device)
            dist.recv(part, self.config.peer_rank)
            whole = torch.empty(share * self._slices, dtype=dtype, device=self.config.device)
            dist.all_gather_into_tensor(whole, part, group=self.config.slice_group)
            flat = whole[:numel]
        else:
            flat = torch.empty(numel, dtype=dtype, device=self.config.device)
            dist.recv(flat, self.config.peer_rank)
        if meta.dtype == torch.bool:
            flat = flat.view(torch.bool)
        return flat.view(meta.shape)

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


def _padded(flat: torch.Tensor, parts: int) -> torch.Tensor:
    extra = -flat.numel() % parts
    return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)

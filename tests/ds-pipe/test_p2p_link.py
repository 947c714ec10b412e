"""``StageLink`` on two real gloo ranks: what one stage sends the other receives bit for bit (single tensors, tuples
of mixed dtypes, layouts that change under ``dynamic_shape``, gradients); one message per activation or gradient
once the layout is known; and a stage that aborts at any point of the exchange makes its neighbour raise
``PipelineAbort`` with its message, promptly, whatever the neighbour was waiting for."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_pipe.p2p import TRAILER_BYTES, Frame, LinkConfig, PipelineAbort, StageLink, TensorMeta


def _link(dynamic: bool = False) -> StageLink:
    rank = dist.get_rank()  # rank 0 is the earlier stage: it sends activations, rank 1 sends gradients
    return StageLink(LinkConfig(stage=rank, peer_stage=1 - rank, peer_rank=1 - rank, device=torch.device("cpu"),
                                dynamic_shape=dynamic))


class _Counting:
    """Counts the messages ``dist.isend`` posts."""

    def __enter__(self):
        self.count, self._original = 0, dist.isend

        def counting(*args, **kwargs):
            self.count += 1
            return self._original(*args, **kwargs)

        dist.isend = counting
        return self

    def __exit__(self, *exc):
        dist.isend = self._original


def _values(i: int, dynamic: bool):
    gen = torch.Generator().manual_seed(i)
    rows = 3 + (i % 2 if dynamic else 0)
    h = torch.randn(rows, 5, generator=gen).requires_grad_()
    mask = torch.rand(rows, generator=gen) > 0.5
    return (h, mask, torch.arange(rows) * 7, torch.randn(rows, 2, generator=gen).to(torch.bfloat16),
            torch.tensor(1.5 + i, dtype=torch.float16))


def _exchange(dynamic: bool) -> dict:
    link, out = _link(dynamic), {"messages": []}
    for i in range(4):
        sent = _values(i, dynamic)
        if dist.get_rank() == 0:
            with _Counting() as c:
                link.send(sent)
            got = link.recv_grads([sent[0]])
            out["messages"].append(c.count)
            assert len(got) == 1 and torch.equal(got[0], sent[0].detach() * 2)
        else:
            got = link.recv()
            assert isinstance(got, tuple) and len(got) == len(sent)
            for a, b in zip(got, sent, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.detach())
                assert a.requires_grad == b.requires_grad
            with _Counting() as c:
                link.send_grads([got[0].detach() * 2])
            out["messages"].append(c.count)
    link.flush()
    single = torch.linspace(-1, 1, 12).reshape(3, 4)
    if dist.get_rank() == 0:
        link.reset_shapes()
        link.send(single)
    else:
        link.reset_shapes()
        got = link.recv()
        assert isinstance(got, torch.Tensor) and torch.equal(got, single) and not got.requires_grad
    link.flush()
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_exchange_is_exact_and_one_message_per_tensor_group(dynamic):
    acts, grads = (r["messages"] for r in run_distributed(_exchange, world_size=2, args=(dynamic,), timeout=60))
    if dynamic:  # a control message before every frame, the layout too whenever it changed (every time here)
        assert acts == [3, 3, 3, 3] and grads == [2, 2, 2, 2]
    else:  # control message and layout once, then one frame per activation / gradient set
        assert acts == [3, 1, 1, 1] and grads == [2, 1, 1, 1]


def test_frame_plan_aligns_tensors_and_splits_shares():
    metas = [TensorMeta(torch.float16, (3,), True), TensorMeta(torch.bool, (5,), False),
             TensorMeta(torch.float64, (2, 2), False)]
    frame = Frame.plan(metas)
    assert [s.offset for s in frame.slots] == [0, 64, 128] and frame.tail == 128 + 32
    assert frame.nbytes == frame.tail + TRAILER_BYTES and frame.slots[1].wire == torch.uint8
    split = Frame.plan(metas, slices=2, split=True)
    assert [s.numel for s in split.slots] == [2, 5, 2] and [s.split for s in split.slots] == [True, False, True]
    assert Frame.plan([]).nbytes == TRAILER_BYTES


# ---- aborts: (who aborts, after how many exchanges, what the other side does) ----------------------------------

def _abort(aborter: int, exchanges: int, dynamic: bool, late: bool) -> dict:
    link, rank = _link(dynamic), dist.get_rank()
    x = torch.randn(2, 3, dtype=torch.float16).requires_grad_()
    for _ in range(exchanges):  # complete activation + gradient round trips
        if rank == 0:
            link.send(x)
            link.recv_grads([x])
        else:
            link.send_grads([link.recv().detach()])
    if rank == aborter:
        link.abort(f"stage {rank} failed: ValueError: bad \u00e9l\u00e9ment")
        return {}
    if late:
        time.sleep(0.5)  # the aborting stage waits for this receive
    start = time.monotonic()
    with pytest.raises(PipelineAbort) as info:
        if rank == 0:
            link.send(x)  # never blocks
            link.recv_grads([x])
        else:
            link.recv()
    assert str(info.value) == f"stage {aborter} failed: ValueError: bad \u00e9l\u00e9ment"
    assert info.value.from_rank == aborter
    return {"seconds": time.monotonic() - start}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("exchanges", [0, 2])
@pytest.mark.parametrize("aborter", [0, 1])
def test_abort_reaches_the_neighbour_whatever_it_waits_for(aborter, exchanges, dynamic):
    got = run_distributed(_abort, world_size=2, args=(aborter, exchanges, dynamic, exchanges == 2), timeout=60)
    assert got[1 - aborter]["seconds"] < 3


def _abort_with_activation_in_flight() -> bool:
    link = _link()
    x = torch.randn(4, 4)
    if dist.get_rank() == 0:
        link.send(x)
        link.send(x)  # not received yet when the stage fails
        link.abort("stage 0 failed")
        return True
    assert torch.equal(link.recv(), x) and torch.equal(link.recv(), x)
    with pytest.raises(PipelineAbort, match="stage 0 failed"):
        link.recv()
    return True


def test_abort_queues_behind_activations_already_sent():
    assert run_distributed(_abort_with_activation_in_flight, world_size=2, timeout=60) == [True, True]

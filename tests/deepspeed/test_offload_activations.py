"""CheckpointHiddenStatesOffload (deepspeed.runtime.activation_checkpointing.offload_activations).

The CPU is a synchronized device, where nothing is offloaded (it is host memory already). To drive the offload and
restore paths here, the module's accelerator is replaced by one that treats the CPU as a device; with
``streams=True`` it also has a side stream whose events complete in a seeded random order (``query`` says "not yet"
until ``synchronize``), so the stream bookkeeping (forward stash, pending host buffers) is exercised in different
orders. Every run is compared bitwise with the run without offloading.
"""

from __future__ import annotations

import contextlib
import random
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import offload_activations as oa
from deepspeed.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)


class _Event:
    def __init__(self, rng: random.Random) -> None:
        self.done = rng.random() < 0.5

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _Stream:
    def __init__(self, rng: random.Random) -> None:
        self.rng, self.events, self.waits = rng, [], 0

    def wait_stream(self, other: _Stream) -> None:
        self.waits += 1

    def wait_event(self, event: _Event) -> None:
        event.synchronize()

    def record_event(self) -> _Event:
        self.events.append(_Event(self.rng))
        return self.events[-1]

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


class _CpuAsDevice:
    """The CPU accelerator, except that CPU tensors count as device tensors (and, with streams, fake streams)."""

    def __init__(self, streams: bool, seed: int = 0) -> None:
        self._real = get_accelerator()
        self._rng = random.Random(seed)
        self._streams = streams
        self._compute = _Stream(self._rng)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._real, name)

    def is_synchronized_device(self) -> bool:
        return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    @property
    def Stream(self):  # noqa: ANN201, N802
        return partial(_Stream, self._rng) if self._streams else None

    def current_stream(self) -> _Stream:
        return self._compute

    def stream(self, stream: _Stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@pytest.fixture
def cpu_as_device(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    recorded = []

    def use(streams: bool = False, seed: int = 0) -> _CpuAsDevice:
        accel = _CpuAsDevice(streams, seed)
        monkeypatch.setattr(oa, "get_accelerator", lambda: accel)
        monkeypatch.setattr(oa, "_record_stream", lambda tensor, stream: recorded.append(stream))
        return accel

    use.recorded = recorded
    return use


def _layers(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4))


def _step(layers: nn.ModuleList, x: torch.Tensor, manager: CheckpointHiddenStatesOffload | None = None):  # noqa: ANN202
    layers.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    h = x
    for layer in layers:
        if manager is not None:
            manager.mark(h)
        h = checkpoint(layer, h, use_reentrant=False)
    loss = h.square().sum()
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in layers.parameters()]


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("keep_last", [0, 1, 2])
@pytest.mark.parametrize("stash", [0, 2])
def test_offloaded_steps_match_no_offload_bitwise(cpu_as_device, streams: bool, keep_last: int, stash: int) -> None:
    layers, x = _layers(), torch.randn(8, 16)
    baseline = _step(layers, x)
    for seed in range(3):  # repeated runs, each with its own event completion order
        cpu_as_device(streams=streams, seed=seed)
        manager = get_checkpoint_hidden_states_offloading_ctx_manager(
            use_streams=streams, min_offload_bytes=0, keep_last_count=keep_last, max_fwd_stash_count=stash)
        assert manager.use_streams is streams
        for _ in range(2):
            with manager:
                _assert_bitwise(_step(layers, x, manager), baseline)
            stats = manager.stats
            assert (stats.marked_tensors, stats.kept_last_tensors) == (4, keep_last)
            assert stats.offloaded_tensors == stats.restored_tensors == 4 - keep_last
            assert stats.offloaded_bytes == stats.restored_bytes == (4 - keep_last) * 8 * 16 * 4
            assert not (manager._tracker or manager._fwd_stash or manager._keep_last or manager._pending_cpu_buffers)
            # every offload's host buffer is back in the pool for the next step (all four share one shape)
            assert manager._cpu_buffer_pool_count == 4 - keep_last


def test_streams_record_and_stash(cpu_as_device) -> None:
    cpu_as_device(streams=True)
    layers, x = _layers(), torch.randn(8, 16)
    manager = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0, max_fwd_stash_count=2)
    with manager:
        h = x.detach().requires_grad_(True)
        for layer in layers:
            manager.mark(h)
            h = checkpoint(layer, h, use_reentrant=False)
        # the two newest offloads are still stashed on the device, the older ones only in host memory
        assert sorted(manager._fwd_stash) == [3, 4]
        assert sorted(manager._tracker) == [1, 2, 3, 4]
        assert len(cpu_as_device.recorded) == 4  # each device tensor recorded on the copy stream
        h.sum().backward()
        # stashed ones came back without a copy; the other two were copied back and recorded on compute
        assert len(cpu_as_device.recorded) == 6
    assert manager.stats.restored_tensors == 4


def test_views_restore_with_their_strides(cpu_as_device) -> None:
    cpu_as_device()
    base = torch.randn(6, 8)
    for view in (base[2:], base[:, ::2]):
        x = view.detach().requires_grad_(True)
        want = torch.autograd.grad(checkpoint(torch.sin, x, use_reentrant=False).square().sum(), x)[0]
        offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
        seen: list[tuple[int, ...]] = []

        def sin(t: torch.Tensor, seen: list = seen) -> torch.Tensor:
            seen.append(t.stride())
            return torch.sin(t)

        with offload:
            offload.mark(x)
            y = checkpoint(sin, x, use_reentrant=False)
            assert next(iter(offload._tracker.values())).host.is_contiguous()
            got = torch.autograd.grad(y.square().sum(), x)[0]
        assert torch.equal(got, want)
        assert seen == [x.stride(), x.stride()]  # forward and recompute see the same layout
        assert offload.stats.offloaded_tensors == 1


def test_what_is_never_offloaded(cpu_as_device) -> None:
    cpu_as_device()
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=64, keep_last_count=0)
    overlapping = torch.randn(4, 8).expand(2, 4, 8)
    for tensor in (torch.randn(4), nn.Parameter(torch.randn(64)), overlapping):
        assert offload.offload_input(tensor) is None
    assert offload.stats.skipped_marked_tensors == 3
    assert offload.offload_input(torch.randn(64)) == 1


def test_cpu_tensors_stay_put_on_the_cpu_accelerator() -> None:
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0)
    assert not offload.use_streams  # the CPU has no copy streams
    x = torch.randn(4, 8, requires_grad=True)
    with offload:
        offload.mark(x)
        checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    assert (offload.stats.offloaded_tensors, offload.stats.skipped_marked_tensors) == (0, 1)
    assert torch.equal(x.grad, torch.cos(x.detach()))


def test_retain_graph_second_backward_reuses_the_restore(cpu_as_device) -> None:
    cpu_as_device()
    x = torch.randn(4, 8, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with offload:
        offload.mark(x)
        loss = checkpoint(torch.sin, x, use_reentrant=False).square().sum()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        x.grad = None
        loss.backward()
    assert offload.stats.restored_tensors == 1
    assert torch.equal(x.grad, first)


def test_backward_after_the_context_is_an_error(cpu_as_device) -> None:
    cpu_as_device()
    x = torch.randn(4, 8, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with offload:
        offload.mark(x)
        loss = checkpoint(torch.sin, x, use_reentrant=False).sum()
    with pytest.raises(RuntimeError, match="no longer tracked"):
        loss.backward()


@pytest.mark.parametrize("name", ["keep_last_count", "max_fwd_stash_count", "max_cpu_buffer_pool_count",
                                  "min_offload_bytes"])
def test_bad_counts_name_the_argument(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 0, got -1"):
        CheckpointHiddenStatesOffload(**{name: -1})


def test_instance_is_not_reentrant_and_nesting_marks_the_innermost() -> None:
    outer, inner = CheckpointHiddenStatesOffload(), CheckpointHiddenStatesOffload()
    with outer:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            outer.__enter__()
        with inner:
            assert oa._offload_marker.current_manager() is inner
        assert oa._offload_marker.current_manager() is outer
    assert oa._offload_marker.current_manager() is None


def test_hf_layers_are_marked_and_match_bitwise(cpu_as_device) -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GradientCheckpointingLayer"):
        pytest.skip("transformers without GradientCheckpointingLayer")

    class Block(transformers.GradientCheckpointingLayer):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.linear(hidden_states))

    original = transformers.GradientCheckpointingLayer.__call__
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3)).train()
    for block in blocks:
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    x = torch.randn(4, 16)

    def step(ctx: contextlib.AbstractContextManager) -> list[torch.Tensor]:
        blocks.zero_grad(set_to_none=True)
        with ctx:
            h = x
            for block in blocks:
                h = block(h)
            h.sum().backward()
        return [p.grad for p in blocks.parameters()]

    want = step(contextlib.nullcontext())
    cpu_as_device()
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=1)
    for _ in range(2):
        _assert_bitwise(step(offload), want)
        assert transformers.GradientCheckpointingLayer.__call__ is original
        assert (offload.stats.marked_tensors, offload.stats.offloaded_tensors) == (3, 2)


@pytest.mark.parametrize("streams", [False, True])
def test_cpu_checkpointing_through_the_offload_engine_is_bitwise(cpu_as_device, monkeypatch, streams: bool) -> None:
    """deepspeed.checkpointing with checkpoint_in_cpu: on a device with copy streams the inputs go through the
    shared offload engine (async copies); gradients equal those of plain checkpointing, step after step."""
    import deepspeed.checkpointing as ckpt
    from deepspeed.runtime.activation_checkpointing import checkpointing as impl

    for name in ("deepspeed_checkpointing_enabled", "CPU_CHECKPOINT", "PARTITION_ACTIVATIONS",
                 "CONTIGUOUS_CHECKPOINTING", "SYNCHRONIZE", "PROFILE_TIME", "num_layers"):
        monkeypatch.setattr(impl, name, getattr(impl, name))  # configure() below: put back after the test
    layers, x = _layers(), torch.randn(8, 16)

    def step() -> list[torch.Tensor]:
        layers.zero_grad(set_to_none=True)
        h = x.detach().requires_grad_(True)
        inp = h
        for layer in layers:
            h = ckpt.checkpoint(layer, h)
        h.square().sum().backward()
        return [inp.grad] + [p.grad for p in layers.parameters()]

    ckpt.configure(None, checkpoint_in_cpu=False)
    want = step()
    for seed in range(3):
        accel = cpu_as_device(streams=streams, seed=seed)
        monkeypatch.setattr(impl, "get_accelerator", lambda accel=accel: accel)
        monkeypatch.setattr(impl, "_offload_engine", None)
        ckpt.configure(None, checkpoint_in_cpu=True)
        for _ in range(2):
            _assert_bitwise(step(), want)
            engine = impl._offload_engine
            assert engine is not None and engine.use_streams is streams
            # four layer inputs: the newest stays on the device, three went through host buffers and came back
            assert engine.stats.offloaded_tensors == engine.stats.restored_tensors == 3
            assert engine.stats.kept_last_tensors == 1
            assert not (engine._tracker or engine._keep_last)
            ckpt.reset()  # zeroes the engine's stats


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (real copy streams)")
def test_cuda_stream_offload_is_bitwise_under_jitter() -> None:
    """The real side-stream path: compute-stream delays of random length between layers shift when the copies
    run against the compute; every step's gradients must still equal those without offloading, bitwise."""
    layers = _layers().cuda()
    x = torch.randn(64, 16, device="cuda")
    want = _step(layers, x)
    rng = random.Random(0)
    manager = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=1, max_fwd_stash_count=1)
    assert manager.use_streams
    for _ in range(10):
        layers.zero_grad(set_to_none=True)
        with manager:
            h = inp = x.detach().requires_grad_(True)
            for layer in layers:
                manager.mark(h)
                torch.cuda._sleep(rng.randrange(0, 200_000))
                h = checkpoint(layer, h, use_reentrant=False)
            loss = h.square().sum()
            loss.backward()
        _assert_bitwise([loss.detach(), inp.grad] + [p.grad for p in layers.parameters()], want)
        assert manager.stats.offloaded_tensors == manager.stats.restored_tensors == 3

"""``deepspeed.checkpointing``: checkpointed forward and gradients bitwise those of the plain model (dropout
included), with partitioned activations on 2 gloo ranks, host checkpointing and contiguous buffers; the RNG
tracker; ``model_parallel_cuda_manual_seed``; configure/reset/is_configured; and activation memory, measured as
the bytes the allocator still holds after the forward (the profiler's per-op allocation accounting), cross-checked
against the bytes of autograd's saved tensors for the plain model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

import deepspeed
import deepspeed.checkpointing as ckpt
from deepspeed.runtime.activation_checkpointing import checkpointing as ckpt_module


@pytest.fixture(autouse=True)
def _defaults():
    ckpt.configure(None)
    ckpt.get_cuda_rng_tracker().reset()
    yield
    ckpt.configure(None)
    ckpt.mpu, ckpt.mp_rank, ckpt.mp_size, ckpt.mp_group = None, 0, 1, None
    ckpt.get_cuda_rng_tracker().reset()


def _model(layers: int = 4, width: int = 16) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.Dropout(0.3), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
        for _ in range(layers)])


def _step(model: torch.nn.Module, x: torch.Tensor, checkpointed: bool) -> tuple[torch.Tensor, list, torch.Tensor]:
    """Forward (every layer checkpointed or not) and gradients; also the next draw of the CPU RNG afterwards."""
    torch.manual_seed(1)
    x = x.detach().requires_grad_()
    h, mask = x, torch.ones(x.shape[0], dtype=torch.long)  # an integer tensor passes through
    for layer in model:
        h = ckpt.checkpoint(lambda a, m, lay=layer: lay(a) * m[:, None], h, mask) if checkpointed else layer(h)
    grads = torch.autograd.grad(h.square().sum(), [x, *model.parameters()])
    return h.detach(), list(grads), torch.rand(4)


def _assert_same(a, b) -> None:
    out_a, grads_a, rng_a = a
    out_b, grads_b, rng_b = b
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(p, q) for p, q in zip(grads_a, grads_b, strict=True))
    assert torch.equal(rng_a, rng_b)  # the recompute leaves the global RNG where the plain step does


def test_module_paths_are_one_module():
    assert deepspeed.checkpointing is ckpt is ckpt_module
    for name in ("configure", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint",
                 "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "CudaRNGStatesTracker"):
        assert callable(getattr(ckpt, name))


@pytest.mark.parametrize("options", [{}, {"checkpoint_in_cpu": True}, {"profile": True, "synchronize": True}])
def test_checkpointed_is_bitwise_plain(options, capsys):
    ckpt.configure(None, **options)
    model, x = _model(), torch.randn(8, 16)
    plain = _step(model, x, checkpointed=False)
    _assert_same(plain, _step(model, x, checkpointed=True))
    if options.get("profile"):
        out = capsys.readouterr().out
        assert "time (ms) | fwd:" in out and "time (ms) | backward:" in out


def test_outputs_and_non_grad_inputs():
    lin = torch.nn.Linear(4, 4)
    x, frozen = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4)
    out, idx, extra = ckpt.checkpoint(lambda a, b, n: (lin(a) + b, torch.arange(n), "tag"), x, frozen, 3)
    assert out.requires_grad and not idx.requires_grad and extra == "tag"
    assert torch.equal(ckpt.checkpoint(lambda b: b * 2, frozen), frozen * 2)
    assert torch.equal(ckpt.non_reentrant_checkpoint(lin, x), lin(x))
    with torch.no_grad():
        assert not ckpt.checkpoint(lin, x).requires_grad


def test_rng_tracker_semantics():
    tracker = ckpt.CudaRNGStatesTracker()
    tracker.add("a", 11)
    with pytest.raises(Exception, match="seed 11 already exists"):
        tracker.add("b", 11)
    with pytest.raises(Exception, match="cuda rng state a already exists"):
        tracker.add("a", 12)
    with pytest.raises(Exception, match="is not added"):
        with tracker.fork("missing"):
            pass
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default state is untouched
    torch.manual_seed(11)
    assert torch.equal(first, torch.rand(3))  # fork ran on the state seeded with 11
    with tracker.fork("a"):
        second = torch.rand(3)
    assert torch.equal(second, torch.rand(3))  # and it advanced
    states = tracker.get_states()
    assert states is not tracker.states_ and states.keys() == {"a"}
    with tracker.fork("a"):
        again = torch.rand(3)
    tracker.set_states(states)  # back to the state before that draw
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), again)
    tracker.reset()
    assert tracker.get_states() == {} and tracker.seeds_ == set()


class _Mpu:
    """A Megatron-style mpu: tensor-parallel group = the whole world, data parallel = this rank."""

    def get_tensor_model_parallel_rank(self):
        return dist.get_rank() if dist.is_initialized() else self.rank

    def get_tensor_model_parallel_world_size(self):
        return dist.get_world_size() if dist.is_initialized() else 1

    def get_tensor_model_parallel_group(self):
        return dist.group.WORLD if dist.is_initialized() else None

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    rank = 0


def test_model_parallel_cuda_manual_seed():
    mpu = _Mpu()
    mpu.rank = 3
    ckpt.configure(mpu)
    ckpt.model_parallel_cuda_manual_seed(42)
    after_seed = torch.rand(3)
    torch.manual_seed(42)
    assert torch.equal(after_seed, torch.rand(3))  # default generator: the data-parallel seed
    with ckpt.get_cuda_rng_tracker().fork():
        tp_draw = torch.rand(3)
    torch.manual_seed(42 + 2718 + 3)
    assert torch.equal(tp_draw, torch.rand(3))  # model-parallel state: seed + 2718 + tp rank
    assert ckpt.get_cuda_rng_tracker().seeds_ == {42 + 2718 + 3}


def test_configure_from_config_dict_and_explicit_arguments_win():
    config = {"train_batch_size": 2, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
        "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}}
    ckpt_module.deepspeed_checkpointing_enabled = False
    assert not ckpt.is_configured()
    ckpt.configure(None, deepspeed_config=config, checkpoint_in_cpu=False, profile=False)
    assert ckpt.is_configured()
    assert (ckpt.PARTITION_ACTIVATIONS, ckpt.CPU_CHECKPOINT, ckpt.CONTIGUOUS_CHECKPOINTING, ckpt.num_layers,
            ckpt.SYNCHRONIZE, ckpt.PROFILE_TIME) == (True, False, True, 4, True, False)
    ckpt.reset()
    assert ckpt.is_configured() and ckpt.contiguous_data_buffers == []
    ckpt.configure(None)
    assert not (ckpt.PARTITION_ACTIVATIONS or ckpt.CONTIGUOUS_CHECKPOINTING or ckpt.PROFILE_TIME)
    with pytest.raises(ValueError, match="partitioned activations"):
        ckpt.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="number of layers"):
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(AssertionError, match="number of layers"):  # DeepSpeed asserts; its callers catch that
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        ckpt.configure(None, deepspeed_config={"train_batch_size": 2, "activation_checkpointing": {"bogus": 1}})


def _alive_bytes_after_forward(fn) -> int:
    """Bytes allocated during ``fn()`` and still held after it (its output included), from the allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    held = sum(event.self_cpu_memory_usage for event in prof.events())
    del out
    return held


def _saved_tensor_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saved during ``fn()`` and still holds."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def _forward(model, x, checkpointed):
    def run():
        h = x
        for layer in model:
            h = ckpt.checkpoint(layer, h) if checkpointed else layer(h)
        return h
    return run


def test_activation_memory_of_16_layer_mlp():
    model, x = _model(layers=16, width=64), torch.randn(32, 64, requires_grad=True)
    plain = _alive_bytes_after_forward(_forward(model, x, False))
    checkpointed = _alive_bytes_after_forward(_forward(model, x, True))
    saved = _saved_tensor_bytes(_forward(model, x, False))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert abs(plain - (saved - params - x.numel() * 4)) <= 0.1 * plain  # the measure sees the saved activations
    assert checkpointed <= plain / 4, (checkpointed, plain)


def _partitioned_rank(options: dict) -> dict:
    ckpt.configure(_Mpu(), partition_activations=True, **options)
    torch.manual_seed(7)
    model, x = _model(layers=3, width=10), torch.randn(6, 10)  # 60 elements: 30 per rank
    got = {}
    plain = _step(model, x, checkpointed=False)
    ckpt.configure(_Mpu(), partition_activations=True, **options)
    # the kept inputs: this rank's half, checked while the graph is alive
    h = x.detach().requires_grad_()
    out = ckpt.checkpoint(model[0], h)
    kept = _kept_of_last_region()
    got["kept_numel"] = [k.data.numel() for k in kept]
    got["kept_device"] = [str(k.data.device) for k in kept]
    if options.get("contiguous_checkpointing"):
        buffer = ckpt.contiguous_data_buffers[0]
        got["in_buffer"] = kept[0].data.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    del out
    ckpt.reset()
    checkpointed = _step(model, x, checkpointed=True)
    _assert_same(plain, checkpointed)
    got["equal"] = True
    return got


_LAST: list = []


def _kept_of_last_region():
    return [k for k in _LAST[-1].kept if isinstance(k, ckpt_module._Kept)]


class _Recording(ckpt_module._RegionInputs):
    def __init__(self, args):
        super().__init__(args)
        _LAST.append(self)


@pytest.mark.parametrize("options", [{}, {"checkpoint_in_cpu": True},
                                     {"contiguous_checkpointing": True, "num_checkpoints": 3}])
def test_partitioned_activations_on_two_ranks(options):
    results = run_distributed(_partitioned_in_worker, world_size=2, args=(options,), timeout=60)
    for got in results:
        assert got["equal"] and got["kept_numel"] == [30] and got["kept_device"] == ["cpu"]
        if "contiguous_checkpointing" in options:
            assert got["in_buffer"]


def _partitioned_in_worker(options: dict) -> dict:
    ckpt_module._RegionInputs, original = _Recording, ckpt_module._RegionInputs
    try:
        return _partitioned_rank(options)
    finally:
        ckpt_module._RegionInputs = original
        ckpt.configure(None)

"""``deepspeed.runtime.zero.stage_1_and_2``: the optimizer the engine builds for ZeRO 1/2 carries DeepSpeed's
bucket-reduction methods (``allreduce_bucket``, ``allreduce_and_copy``, ``allreduce_no_retain``,
``allreduce_and_copy_with_multiple_ranks``, ``average_tensor``, ...) and ``IPGBucket``; on gloo ranks they
average exactly as a hand-made mean does, each rank keeping only what it consumes; the stream bookkeeping is
checked with a stand-in accelerator (the CPU orders its work by itself)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from _harness import run_distributed


def _engine(zero: dict):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 2, **zero},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    return engine


def _per_rank(shape: tuple[int, ...], rank: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed * 100 + rank))


def _copy_body() -> dict:
    import torch.distributed as dist

    import ds_zero.stage_1_and_2 as plain
    from deepspeed.runtime.zero import stage_1_and_2 as zero12

    engine = _engine({"overlap_comm": True})
    opt = engine.optimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"types": isinstance(opt, zero12.DeepSpeedZeroOptimizer) and isinstance(opt, plain.DeepSpeedZeroOptimizer),
           "flags": (opt.overlap_comm, opt.reduce_scatter, opt.gradient_average, opt.dp_process_group is opt.dp_group)}
    shapes = [(3,), (2, 4), (5,)]
    mean = [sum(_per_rank(s, r, i) for r in range(world)) / world for i, s in enumerate(shapes)]
    bucket = [_per_rank(s, rank, i) for i, s in enumerate(shapes)]
    opt.allreduce_and_copy(bucket, torch.float32)
    out["all"] = all(torch.allclose(b, m, rtol=0, atol=1e-6) for b, m in zip(bucket, mean, strict=True))
    pieces = [_per_rank(s, rank, i) for i, s in enumerate(shapes)]
    opt.allreduce_no_retain(pieces, torch.float32, numel_per_bucket=4)  # cut into several reductions
    out["pieces"] = all(torch.equal(a, b) for a, b in zip(pieces, bucket, strict=True))
    mine = [_per_rank(s, rank, i) for i, s in enumerate(shapes)]
    opt.allreduce_and_copy(mine, torch.bfloat16, rank=0)  # reduced to rank 0 only, sent in bf16
    kept = [_per_rank(s, rank, i) for i, s in enumerate(shapes)]
    out["to_rank0"] = all((torch.allclose(a, m, atol=2e-2) if rank == 0 else torch.equal(a, k))
                          for a, m, k in zip(mine, mean, kept, strict=True))
    consumers = [frozenset((0, 1)), 1, frozenset((0,))]
    multi = [_per_rank(s, rank, i) for i, s in enumerate(shapes)]
    opt.allreduce_and_copy_with_multiple_ranks(multi, torch.float32, bucket_ranks=consumers)
    out["multi"] = [torch.equal(a, b) for a, b in zip(multi, bucket, strict=True)]
    return out


def test_bucket_reductions_average_across_ranks():
    results = run_distributed(_copy_body, world_size=2, timeout=120)
    for rank, r in enumerate(results):
        assert r["types"] and r["flags"] == (True, True, True, True)
        assert r["all"] and r["pieces"] and r["to_rank0"]
        assert r["multi"] == [True, rank == 1, rank == 0]


def _average_body(zero: dict) -> dict:
    import torch.distributed as dist

    from deepspeed.runtime.zero import stage_1_and_2 as zero12

    engine = _engine(zero)
    opt = engine.optimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    (group,) = opt.groups
    bucket = zero12.IPGBucket()
    order = list(range(len(group.params)))[::-1]  # backward's order
    bucket.params = [(0, i, id(group.params[i])) for i in order]
    opt.ipg_buckets[torch.float32] = bucket
    numels = [group.params[i].numel() for i in order]
    packed = _per_rank((sum(numels),), rank, 7)
    before = packed.clone()
    mean = sum(_per_rank((sum(numels),), r, 7) for r in range(world)) / world
    opt.average_tensor(packed, torch.float32)
    if not opt.reduce_scatter:
        return {"whole": torch.allclose(packed, mean, rtol=0, atol=1e-6)}
    # which elements of the packed tensor fall into this rank's partition of the flat buffer
    mine = torch.zeros(sum(numels), dtype=torch.bool)
    offset = 0
    for i, n in zip(order, numels, strict=True):
        for owner, frag in group.layout.owners(i):
            if owner == rank:
                mine[offset + frag.tensor_offset: offset + frag.tensor_offset + frag.numel] = True
        offset += n
    return {"owned": torch.allclose(packed[mine], mean[mine], rtol=0, atol=1e-6),
            # the others' slices are scratch afterwards (gloo's reduce may use a lone slice as its buffer); with
            # the exchange they only went through the in-place division before the sends
            "others_divided": torch.equal(packed[~mine], before[~mine] / world),
            "some_owned": bool(mine.any()), "some_not": bool((~mine).any())}


@pytest.mark.parametrize("zero", [{"reduce_scatter": True}, {"reduce_scatter": True, "use_multi_rank_bucket_allreduce":
                                                                False}, {"reduce_scatter": False}],
                         ids=["exchange", "reduce_per_rank", "allreduce"])
def test_average_tensor_gives_each_owner_its_mean(zero):
    for r in run_distributed(_average_body, world_size=2, args=(zero,), timeout=120):
        if "whole" in r:
            assert r["whole"]
        else:
            assert r["owned"] and r["some_owned"] and r["some_not"]
            assert r["others_divided"] or zero.get("use_multi_rank_bucket_allreduce") is False


def _predivide_body() -> bool:
    import torch.distributed as dist

    engine = _engine({"reduce_scatter": False})
    opt = engine.optimizer
    opt.gradient_predivide_factor = 2.0  # half before the sum, the rest after: still the mean
    t = _per_rank((6,), dist.get_rank(), 3)
    opt.gradient_reduction_w_predivide(t, torch.float32)
    mean = sum(_per_rank((6,), r, 3) for r in range(dist.get_world_size())) / dist.get_world_size()
    return torch.allclose(t, mean, rtol=0, atol=1e-6)


def test_gradient_reduction_w_predivide_is_the_mean():
    assert run_distributed(_predivide_body, world_size=2, timeout=120) == [True, True]


def test_ipg_bucket_clear_keeps_buffers():
    from deepspeed.runtime.zero.stage_1_and_2 import IPGBucket

    bucket = IPGBucket(buffer=[torch.zeros(4)], params=[(0, 1, 2)], grads=[torch.ones(1)], elements=3,
                       has_moe_params=True, copy_streams={"s"})
    bucket.clear()
    assert (bucket.params, bucket.grads, bucket.elements, bucket.has_moe_params, bucket.copy_streams) == \
        ([], [], 0, False, set())
    assert len(bucket.buffer) == 1


class _Stream:
    def __init__(self) -> None:
        self.waited: list = []

    def wait_stream(self, other) -> None:
        self.waited.append(other)


class _Tensor:
    """Stands in for a device tensor: records copies and stream records."""

    def __init__(self) -> None:
        self.streams: list = []
        self.source = None

    def copy_(self, other):
        self.source = other
        return self

    def record_stream(self, stream) -> None:
        self.streams.append(stream)


class _Accelerator:
    def __init__(self, current: _Stream, ordered: bool) -> None:
        self.current, self.ordered = current, ordered

    def resolves_data_dependency(self) -> bool:
        return self.ordered

    def stream(self, stream):
        return nullcontext()

    def current_stream(self):
        return self.current

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("ordered", [False, True], ids=["device_streams", "ordered_device"])
def test_overlapped_reduction_records_and_waits_on_streams(monkeypatch, ordered):
    from deepspeed.runtime.zero import stage_1_and_2 as zero12

    current = _Stream()
    monkeypatch.setattr(zero12, "get_accelerator", lambda: _Accelerator(current, ordered))
    monkeypatch.setattr(zero12.dist, "get_rank", lambda group=None: 1)
    opt = zero12.DeepSpeedZeroOptimizer.__new__(zero12.DeepSpeedZeroOptimizer)
    opt.overlap_comm, opt.reduce_scatter, opt.reduction_stream = True, False, _Stream()
    opt.dp_process_group, opt.previous_reduced_grads = None, {}
    reduced, synced = _Tensor(), [object(), object()]
    opt.allreduce_bucket = lambda *args, **kwargs: reduced
    opt.unflatten = lambda flat, bucket: synced
    bucket = [_Tensor(), _Tensor()]
    opt.allreduce_and_copy_with_multiple_ranks(bucket, torch.float16, bucket_ranks=[0, frozenset((1, 0))])
    expected = [] if ordered else [opt.reduction_stream]
    assert reduced.streams == expected
    assert (bucket[0].source, bucket[0].streams) == (None, [])  # consumed by rank 0 only
    assert (bucket[1].source, bucket[1].streams) == (synced[1], expected)

    producers = {object(), object()}
    ipg = zero12.IPGBucket(copy_streams=set(producers))
    opt.ipg_buckets = {torch.float16: ipg}
    calls = []
    opt.gradient_reduction_w_predivide = lambda tensor, dtype: calls.append(dtype)
    opt.reduction_stream = _Stream()
    opt.average_tensor(torch.zeros(2), torch.float16)
    assert calls == [torch.float16]
    assert set(opt.reduction_stream.waited) == (set() if ordered else producers)
    assert current.waited == ([] if ordered else [opt.reduction_stream])

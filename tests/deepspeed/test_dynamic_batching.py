"""Dynamic batching (``data_efficiency.data_sampling.dynamic_batching``): token-budget packing, the loader over two
ranks and the LR scaling schedule, against analytic expectations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
    VariableBatchSizeLR,
    batch_by_seqlens,
    dataloader_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    lr_scheduler_for_variable_batch_size,
    scale_lr,
)

SEQLENS = [3, 5, 2, 8, 1, 4, 7, 6, 2, 3, 9, 1, 5, 5, 2, 7]


def _flat(microbatch_ids):
    return [i for _, ids in microbatch_ids for i in ids]


@settings(max_examples=60, deadline=None)
@given(seqlens=st.lists(st.integers(1, 12), min_size=1, max_size=60), max_tokens=st.integers(1, 30),
       min_size=st.integers(1, 3), extra=st.one_of(st.none(), st.integers(0, 4)),
       order=st.sampled_from(["dataloader", "random", "seqlen"]), effective=st.integers(1, 3))
def test_packing_respects_budget_bounds_and_uses_each_sample_once(seqlens, max_tokens, min_size, extra, order,
                                                                  effective):
    max_size = None if extra is None else min_size + extra
    try:
        untrimmed, _, _ = batch_by_seqlens(seqlens, max_tokens, None, min_size, max_size, order, 1, seed=7)
    except ValueError as err:  # not even one micro batch of min_size samples fits at the start
        assert "make 0 micro batches" in str(err)
        return
    for _, ids in untrimmed:
        assert sum(seqlens[i] for i in ids) <= max_tokens
        assert min_size <= len(ids) and (max_size is None or len(ids) <= max_size)
    used = _flat(untrimmed)
    assert len(used) == len(set(used))  # no sample twice
    fitting = [i for i, n in enumerate(seqlens) if n <= max_tokens]
    if min_size == 1:  # nothing but too-long samples is left out
        assert sorted(used) == fitting
    if order == "dataloader":
        assert used == sorted(used)
    if order == "seqlen":
        assert [seqlens[i] for i in used] == sorted(seqlens[i] for i in used)
    if len(untrimmed) < effective:
        with pytest.raises(ValueError, match="effective_batch_size"):
            batch_by_seqlens(seqlens, max_tokens, None, min_size, max_size, order, effective, seed=7)
        return
    trimmed, sizes, longest = batch_by_seqlens(seqlens, max_tokens, None, min_size, max_size, order, effective, seed=7)
    # the same micro batches, only the tail that cannot fill a whole batch dropped
    assert [ids for _, ids in trimmed] == [ids for _, ids in untrimmed][:len(untrimmed) // effective * effective]
    assert [b for b, _ in trimmed] == [k // effective for k in range(len(trimmed))]
    assert sizes == [sum(len(ids) for b, ids in trimmed if b == k) for k in range(len(sizes))]
    assert longest == [max(seqlens[i] for b, ids in trimmed if b == k for i in ids) for k in range(len(sizes))]


def test_micro_batches_are_the_longest_that_fit():
    mbs, sizes, longest = batch_by_seqlens(SEQLENS, 10, effective_batch_size=1)
    ids = [ids for _, ids in mbs]
    assert ids == [[0, 1, 2], [3, 4], [5], [6], [7, 8], [9], [10, 11], [12, 13], [14, 15]]
    for this, nxt in zip(ids, ids[1:], strict=False):  # adding the next sample would break the budget
        assert sum(SEQLENS[i] for i in this) + SEQLENS[nxt[0]] > 10
    assert sizes == [len(i) for i in ids] and longest == [max(SEQLENS[i] for i in m) for m in ids]
    capped, _, _ = batch_by_seqlens(SEQLENS, 100, max_batch_size=4, effective_batch_size=1)
    assert [len(m) for _, m in capped] == [4, 4, 4, 4]


def test_orders_and_seed():
    shuffled = _flat(batch_by_seqlens(SEQLENS, 12, sequence_picking_order="random", seed=1)[0])
    again = _flat(batch_by_seqlens(SEQLENS, 12, sequence_picking_order="random", seed=1)[0])
    other = _flat(batch_by_seqlens(SEQLENS, 12, sequence_picking_order="random", seed=2)[0])
    assert shuffled == again and shuffled != other and sorted(shuffled) == list(range(len(SEQLENS)))
    subset = _flat(batch_by_seqlens(SEQLENS, 12, sequence_ids_per_mb=[1, 3, 5, 7])[0])
    assert subset == [1, 3, 5, 7]
    too_long = _flat(batch_by_seqlens(SEQLENS, 6)[0])
    assert set(too_long) == {i for i, n in enumerate(SEQLENS) if n <= 6}


def test_equal_size_micro_batches_for_pipelines():
    mbs, sizes, _ = batch_by_seqlens(SEQLENS, 10, effective_batch_size=2, required_microbatches_of_same_size=True)
    for b in range(len(sizes)):
        counts = {len(ids) for k, ids in mbs if k == b}
        assert len(counts) == 1 and sizes[b] == 2 * counts.pop()
    assert all(sum(SEQLENS[i] for i in ids) <= 10 for _, ids in mbs)


@pytest.mark.parametrize("kwargs, key", [({"max_tokens": 0}, "max_tokens"), ({"min_batch_size": 0}, "min_batch_size"),
                                         ({"max_batch_size": 0}, "max_batch_size"),
                                         ({"sequence_picking_order": "longest"}, "sequence_picking_order"),
                                         ({"effective_batch_size": 0}, "effective_batch_size")])
def test_bad_arguments_name_the_argument(kwargs, key):
    args = {"max_tokens": 10, **kwargs}
    with pytest.raises(ValueError, match=key):
        batch_by_seqlens(SEQLENS, **args)


def test_scale_lr_formulas():
    assert scale_lr(4, 8, 0.1, "linear") == pytest.approx(0.2)
    assert scale_lr(4, 1, 0.1, "sqrt") == pytest.approx(0.05)
    assert scale_lr(4, 9, 0.1, "none") == 0.1 and scale_lr(4, 9, 0.1, None) == 0.1
    with pytest.raises(ValueError, match="method='cubic'.*linear, sqrt, none"):
        scale_lr(4, 9, 0.1, "cubic")


@pytest.mark.parametrize("method", ["linear", "sqrt", "none"])
def test_lr_schedule_scales_the_wrapped_schedule(method):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    base = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sizes = [2, 8, 4, 1]
    sched = lr_scheduler_for_variable_batch_size(4, sizes, None, base, method)
    assert isinstance(sched, VariableBatchSizeLR)
    for step in range(6):
        unscaled = 0.4 * 0.5 ** step  # the wrapped StepLR, never fed a scaled LR
        assert opt.param_groups[0]["lr"] == pytest.approx(scale_lr(4, sizes[step % 4], unscaled, method))
        assert sched.get_last_lr() == pytest.approx([unscaled])
        opt.step()
        sched.step()
    state = sched.state_dict()
    fresh_opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.4)
    fresh = lr_scheduler_for_variable_batch_size(4, sizes, None, torch.optim.lr_scheduler.StepLR(fresh_opt, 1, 0.5),
                                                 method)
    fresh.load_state_dict(state)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    ds_state = {k: v for k, v in state.items() if k != "unscaled_lrs"}  # DeepSpeed's checkpoints lack it
    fresh.load_state_dict(ds_state)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_lr_schedule_over_a_constant_optimizer_and_unwrap():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.3)
    sched = lr_scheduler_for_variable_batch_size(2, [1, 6], None, opt, "linear")
    assert opt.param_groups[0]["lr"] == pytest.approx(0.15)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.9)
    assert sched.unwrap() is None and opt.param_groups[0]["lr"] == pytest.approx(0.3)
    with pytest.raises(TypeError, match="accepted: a torch optimizer or an LR schedule"):
        lr_scheduler_for_variable_batch_size(2, [1], None, "adam")
    with pytest.raises(ValueError, match="lr_scaling_method|method='exp'"):
        lr_scheduler_for_variable_batch_size(2, [1], None, opt, "exp")


def test_loader_collates_and_pads():
    data = [torch.arange(n) for n in SEQLENS]
    mbs, sizes, longest = batch_by_seqlens(SEQLENS, 10, effective_batch_size=2)
    loader, kwargs = dataloader_for_variable_batch_size(data, mbs, longest, dataloader_batch_size=2,
                                                        dataloader_num_workers=0)
    batches = list(loader)
    assert len(batches) == len(sizes) and [len(b) for b in batches] == sizes  # raw sample lists, one batch per step
    assert kwargs["batch_size"] == 2 and len(kwargs["dataset"]) == len(mbs)
    pad = lambda sample, n: torch.nn.functional.pad(sample, (0, n - len(sample)))  # noqa: E731
    padded, _ = dataloader_for_variable_batch_size(data, mbs, longest, dataloader_batch_size=2,
                                                   dataloader_num_workers=0, dataloader_collate_fn=torch.stack,
                                                   required_microbatches_of_same_seqlen=True, sample_padding_fn=pad)
    assert [tuple(b.shape) for b in padded] == [(s, n) for s, n in zip(sizes, longest, strict=True)]
    with pytest.raises(ValueError, match="sample_padding_fn"):
        dataloader_for_variable_batch_size(data, mbs, longest, required_microbatches_of_same_seqlen=True)


def _two_rank_loaders(seqlens, max_tokens):
    import torch.distributed as dist

    rank = dist.get_rank()
    data = [torch.tensor([i, n]) for i, n in enumerate(seqlens)]
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loader, sched, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        data, seqlens, max_tokens, effective_batch_size=4, dataloader_batch_size=2, dataloader_rank=rank,
        dataloader_num_replicas=2, lr_scheduler_or_optimizer=opt, sequence_picking_order="seqlen")
    steps = []
    for batch in loader:
        ids = [int(s[0]) for s in batch]
        counts = torch.tensor([len(ids)])
        dist.all_reduce(counts)  # the whole step's samples, over both ranks
        steps.append((ids, int(counts), opt.param_groups[0]["lr"]))
        sched.step()
    return steps, sched.batch_sizes


def test_two_ranks_get_the_same_number_of_micro_batches_and_every_sample_once():
    from _harness import run_distributed

    seqlens = [(i * 7) % 11 + 1 for i in range(40)]
    (steps0, sizes), (steps1, sizes1) = run_distributed(_two_rank_loaders, world_size=2, args=(seqlens, 12),
                                                        timeout=60)
    assert sizes == sizes1 and len(steps0) == len(steps1) == len(sizes)
    seen = [i for ids, _, _ in steps0 + steps1 for i in ids]
    assert len(seen) == len(set(seen)) and len(seen) == sum(sizes)
    for step, ((ids0, total, lr0), (ids1, _, lr1)) in enumerate(zip(steps0, steps1, strict=True)):
        assert total == sizes[step]  # both ranks together consume exactly the planned batch
        assert lr0 == lr1 == pytest.approx(sizes[step] / 4)  # linear: 1.0 * samples / effective batch
        assert sum(seqlens[i] for i in ids0) <= 2 * 12 and sum(seqlens[i] for i in ids1) <= 2 * 12
    assert math.isclose(sum(sizes), len(seen))


def test_effective_batch_must_be_whole_loader_steps():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    with pytest.raises(ValueError, match="effective_batch_size=3 must be a multiple of .* = 2"):
        get_dataloader_and_lr_scheduler_for_variable_batch_size(
            list(range(16)), SEQLENS, 10, effective_batch_size=3, dataloader_batch_size=2,
            lr_scheduler_or_optimizer=opt)
    loader, sched, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        list(range(16)), SEQLENS, 10, effective_batch_size=2, dataloader_batch_size=2, lr_scheduler_or_optimizer=opt)
    assert [len(b) for b in loader] == sched.batch_sizes  # one loader batch per optimizer step


def test_constants_name_the_typed_config_keys_and_defaults():
    from deepspeed.runtime.data_pipeline import constants as C
    from ds_config.data_efficiency import DataSamplingConfig, DynamicBatchingConfig

    db = DynamicBatchingConfig()
    for key, default in ((C.DYNAMIC_BATCHING_ENABLED, C.DYNAMIC_BATCHING_ENABLED_DEFAULT),
                         (C.DYNAMIC_BATCHING_LR_SCALING_METHOD, C.DYNAMIC_BATCHING_LR_SCALING_METHOD_DEFAULT),
                         (C.DYNAMIC_BATCHING_MIN_BATCH_SIZE, C.DYNAMIC_BATCHING_MIN_BATCH_SIZE_DEFAULT),
                         (C.DYNAMIC_BATCHING_MAX_BATCH_SIZE, C.DYNAMIC_BATCHING_MAX_BATCH_SIZE_DEFAULT),
                         (C.DYNAMIC_BATCHING_SEQUENCE_PICKING_ORDER, C.DYNAMIC_BATCHING_SEQUENCE_PICKING_ORDER_DEFAULT),
                         (C.DYNAMIC_BATCHING_METRICS_PATH, None), (C.DYNAMIC_BATCHING_MAX_TOKENS, None),
                         (C.DYNAMIC_BATCHING_VERBOSE, False)):
        assert getattr(db, key) == default, key
    sampling = DataSamplingConfig()
    assert sampling.pin_memory == C.DATA_SAMPLING_PIN_MEMORY_DEFAULT
    assert sampling.num_epochs == C.DATA_SAMPLING_NUM_EPOCHS_DEFAULT
    assert getattr(sampling, C.DYNAMIC_BATCHING) == db


def test_engine_hook_only_for_the_training_route_and_not_with_curriculum_sampling():
    from types import SimpleNamespace

    from deepspeed.runtime.engine import _data_efficiency
    from ds_config.data_efficiency import DataEfficiencyConfig

    both = DataEfficiencyConfig.model_validate({"data_sampling": {
        "dynamic_batching": {"enabled": True, "max_tokens": 8},
        "curriculum_learning": {"enabled": True, "data_cluster_path": "/tmp/c", "curriculum_metrics": {"m": {
            "difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 1,
            "max_difficulty": 2, "schedule_type": "custom"}}}}})
    engine = SimpleNamespace(_config=SimpleNamespace(data_efficiency=both))
    assert _data_efficiency.dynamic_batching_io(engine, [], "eval", None, None) is None
    assert _data_efficiency.dynamic_batching_io(engine, [], "train", object(), None) is None  # caller's sampler
    with pytest.raises(ValueError, match="dynamic_batching and curriculum_learning cannot both be enabled"):
        _data_efficiency.dynamic_batching_io(engine, [], "train", None, None)

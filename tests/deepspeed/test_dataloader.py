"""``DeepSpeedDataLoader`` and ``RepeatingLoader``: sharding across data-parallel ranks (exactly once per
epoch, padding when the dataset does not divide), ``drop_last``, per-epoch reshuffling, ``len``, collate_fn."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed
from torch.utils.data import SequentialSampler, TensorDataset

from deepspeed.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader


class _Timer:
    def __init__(self) -> None:
        self.starts = 0

    def start(self) -> None:
        self.starts += 1


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.arange(n) * 10)


def _ids(loader) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


def _loader(n: int, micro: int, world: int, rank: int, drop_last: bool = False, **kw) -> DeepSpeedDataLoader:
    return DeepSpeedDataLoader(_dataset(n), micro, False, 0, kw.pop("timer", None), data_parallel_world_size=world,
                               data_parallel_rank=rank, dataloader_drop_last=drop_last, **kw)


def _epochs_on_rank(n: int, micro: int, drop_last: bool):
    """Runs on each rank of a real group: placement comes from the process group itself."""
    loader = DeepSpeedDataLoader(_dataset(n), micro, False, 0, None, dataloader_drop_last=drop_last)
    seen = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen.append(_ids(loader))
    return len(loader), seen


@pytest.mark.parametrize("drop_last", [False, True])
def test_two_ranks_cover_the_dataset_once_per_epoch(drop_last):
    # 10 samples, 2 ranks: 5 each; micro batch 2 -> batches of 2, 2, 1 (the 1 is dropped with drop_last)
    out = run_distributed(_epochs_on_rank, 2, args=(10, 2, drop_last), timeout=30)
    assert [length for length, _ in out] == ([2, 2] if drop_last else [3, 3])
    for epoch in range(2):
        shards = [[i for batch in seen[epoch] for i in batch] for _, seen in out]
        assert all(len(batch) == 2 for _, seen in out for batch in seen[epoch]) == drop_last
        assert not set(shards[0]) & set(shards[1])
        if drop_last:
            assert len(shards[0]) == len(shards[1]) == 4
        else:
            assert sorted(shards[0] + shards[1]) == list(range(10))  # every sample exactly once
    first, second = ([i for b in seen[e] for i in b] for e in range(2) for seen in [out[0][1]])
    assert first != second  # a new shuffle each epoch


def test_uneven_dataset_is_padded_so_ranks_take_equal_steps():
    shards = [[i for b in _ids(_loader(11, 4, 2, r)) for i in b] for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 6  # 11 padded to 12
    everything = shards[0] + shards[1]
    assert set(everything) == set(range(11)) and len(everything) - len(set(everything)) == 1
    assert len(_loader(11, 4, 2, 0)) == 2 and len(_loader(11, 4, 2, 0, drop_last=True)) == 1


def test_same_epoch_same_order_and_reshuffle():
    a, b = _loader(20, 3, 2, 1), _loader(20, 3, 2, 1)
    assert _ids(a) == _ids(b)  # seed 0: every rank and every restart agree
    a.set_epoch(0)
    before = _ids(a)
    a.set_epoch(1)
    after = _ids(a)
    assert before != after and len(sum(before, [])) == len(sum(after, [])) == 10
    b.set_epoch(1)
    other_rank = _loader(20, 3, 2, 0)
    other_rank.set_epoch(1)
    assert sorted(sum(after, []) + sum(_ids(other_rank), [])) == list(range(20))  # the shuffle is global


def test_collate_fn_timer_and_micro_batch():
    timer = _Timer()

    def collate(samples):
        return {"x": torch.stack([s[0] for s in samples]), "y": torch.stack([s[1] for s in samples])}

    loader = _loader(9, 4, 1, 0, collate_fn=collate, timer=timer)
    batches = list(loader)
    assert [len(b["x"]) for b in batches] == [4, 4, 1] and len(loader) == 3
    assert all(torch.equal(b["y"], b["x"] * 10) for b in batches)
    assert timer.starts == 4  # before every fetch (loading counts as step time), the exhausted one included
    assert loader.num_local_io_workers == 0  # CPU: no loader processes competing with the ranks


def test_explicit_sampler_and_single_process_mode():
    ordered = DeepSpeedDataLoader(_dataset(5), 2, False, 0, None, data_sampler=SequentialSampler(range(5)))
    assert _ids(ordered) == [[0, 1], [2, 3], [4]]
    with pytest.raises(TypeError, match="SequentialSampler has no set_epoch"):
        ordered.set_epoch(1)
    local = DeepSpeedDataLoader(_dataset(6), 2, False, -1, None)  # one process, random order
    assert sorted(sum(_ids(local), [])) == list(range(6)) and len(local) == 3


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        _loader(4, 0, 1, 0)
    with pytest.raises(ValueError, match=r"data_parallel_rank=2 must be in \[0, data_parallel_world_size=2\)"):
        _loader(4, 1, 2, 2)


def test_repeating_loader_restarts_with_a_new_epoch():
    loader = _loader(4, 2, 1, 0)
    repeating = RepeatingLoader(loader)
    first = [next(repeating)[0].tolist() for _ in range(2)]
    second = [next(repeating)[0].tolist() for _ in range(2)]
    assert loader.data_sampler.epoch == 1 and iter(repeating) is repeating
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == [0, 1, 2, 3]
    plain = RepeatingLoader([1, 2])
    assert [next(plain) for _ in range(5)] == [1, 2, 1, 2, 1]

"""Data Efficiency Library data sampling: indexed dataset files, DataAnalyzer index building, DeepSpeedDataSampler.

References: the ``.idx``/``.bin`` bytes, the analyzer's file hashes and the sampler's batches were recorded by
running DeepSpeed 0.19.8 (``MMapIndexedDatasetBuilder``, ``DataAnalyzer``, ``DeepSpeedDataSampler``) on the same
inputs; the index contents and curriculum schedules are also checked against numpy/closed-form references
computed here from the toy dataset's known difficulties (``tests/_data_sampling_toy.py``).
"""

from __future__ import annotations

import hashlib
import io
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _data_sampling_toy import METRIC, N, ToyDataset, analyze, data_efficiency, difficulty_metric, difficulty_of
from _harness import run_distributed

from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)
from deepspeed.runtime.data_pipeline.data_sampling.utils import find_fit_int_dtype

# DeepSpeed 0.19.8: builder(dtype=uint16); add_item_numpy([1, 2, 3]); add_item_numpy([7]); end_document(); finalize
DS_IDX = ("4d4d494449445800000100000000000000060200000000000000020000000000000003000000010000000000000000000000060000"
          "000000000000000000000000000200000000000000")
DS_BIN = "0100020003000700"


# sha256 (first 16 hex digits) of the index files DeepSpeed 0.19.8's DataAnalyzer writes for the toy dataset with
# num_threads=2, num_threads_reduce=2, batch_size=5 (the whole save_path tree is identical, per-thread files too)
DS_INDEX_SHA256 = {
    "sample_to_metric": ("eb65ebe1db03c14b", "a029ca1617b13901"),
    "index_to_sample": ("cea78885d950c326", "d88271d6a01e62cb"),
    "index_to_metric": ("b1e23b106f5c7b59", "206402cab3454157"),
    "index_to_sample_percentile_merged": ("a8f21a3fbdc18cff", "d88271d6a01e62cb"),
}

# the first 16 micro batches of DeepSpeed 0.19.8's DeepSpeedDataSampler (micro 4, gas 2, one rank, seed 1234) on
# those files with data_efficiency(index, ..., difficulty_type=...) of _data_sampling_toy
DS_BATCHES = {
    "value": [[14, 2, 13, 0], [3, 15, 27, 39], [40, 24, 29, 28], [4, 1, 38, 25], [36, 26, 6, 16], [12, 38, 0, 37],
              [39, 25, 19, 17], [15, 12, 36, 37], [1, 27, 33, 3], [26, 41, 42, 8], [31, 14, 2, 46], [5, 9, 13, 24],
              [12, 47, 18, 2], [7, 0, 25, 10], [27, 11, 30, 34], [37, 32, 45, 43]],
    "percentile": [[1, 0, 13, 24], [2, 14, 25, 37], [24, 27, 37, 12], [4, 13, 38, 36], [3, 16, 1, 12],
                   [41, 0, 40, 6], [30, 29, 39, 25], [18, 5, 7, 36], [1, 8, 15, 39], [28, 14, 2, 26],
                   [33, 24, 17, 43], [16, 0, 38, 21], [28, 23, 46, 36], [20, 13, 26, 31], [42, 40, 6, 2],
                   [45, 10, 32, 9]],
}


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> dict[str, str]:
    """The toy dataset analysed with 2 map and 2 reduce processes (forked)."""
    return analyze(str(tmp_path_factory.mktemp("analysis")), num_threads=2, num_threads_reduce=2)


def _items(prefix: str) -> list[list[int]]:
    data = MMapIndexedDataset(prefix)
    return [[int(v) for v in data[i]] for i in range(len(data))]


# ---- indexed dataset files ---------------------------------------------------------------------------------
def test_indexed_dataset_files_are_byte_identical_to_deepspeeds(tmp_path):
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    builder.add_item_numpy(np.array([1, 2, 3]))
    builder.add_item(torch.tensor([7]))
    builder.end_document()
    builder.finalize(str(tmp_path / "x.idx"))
    assert (tmp_path / "x.idx").read_bytes().hex() == DS_IDX and (tmp_path / "x.bin").read_bytes().hex() == DS_BIN
    data = MMapIndexedDataset(str(tmp_path / "x"))
    assert len(data) == 2 and data.dtype is np.uint16 and list(data.doc_idx) == [0, 2]
    assert [list(a) for a in data[0:2]] == [[1, 2, 3], [7]] and list(data.get(0, 1, 1)) == [2]


def test_indexed_dataset_merge_and_errors(tmp_path):
    for name, items in (("a", [[1], [2, 3]]), ("b", [[]]), ("c", [[4, 5, 6]])):
        builder = MMapIndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=np.int32)
        builder.add_items([np.array(i) for i in items])
        builder.end_document()
        builder.finalize(str(tmp_path / f"{name}.idx"))
    merged = MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=torch.int32)
    for name in "abc":
        merged.merge_file_(str(tmp_path / name))
    merged.finalize(str(tmp_path / "m.idx"))
    assert _items(str(tmp_path / "m")) == [[1], [2, 3], [], [4, 5, 6]]
    with pytest.raises(ValueError, match="float32.* is not supported by indexed datasets; accepted: uint8"):
        MMapIndexedDatasetBuilder(str(tmp_path / "f.bin"), dtype=np.float32)
    with pytest.raises(FileNotFoundError, match="missing.idx does not exist"):
        MMapIndexedDataset(str(tmp_path / "missing"))
    assert find_fit_int_dtype(0, 255) is np.uint8 and find_fit_int_dtype(0, 256) is np.uint16
    assert find_fit_int_dtype(-1, 127) is np.int8 and find_fit_int_dtype(-129, 0) is np.int16


# ---- DataAnalyzer ------------------------------------------------------------------------------------------
def test_analyzer_writes_the_documented_index_files(index):
    metrics = np.array([difficulty_of(i) for i in range(N)])
    assert _items(index["sample_to_metric"]) == [[int(m)] for m in metrics]
    values = sorted(set(metrics.tolist()))
    assert _items(index["index_to_metric"]) == [[v] for v in values]
    assert _items(index["index_to_sample"]) == [np.flatnonzero(metrics == v).tolist() for v in values]
    # 12 distinct values -> merge step max(1, 12 // 100) = 1: the percentile file has the same rows
    assert _items(index["index_to_sample_percentile_merged"]) == _items(index["index_to_sample"])
    order = [s for row in _items(index["index_to_sample"]) for s in row]
    assert [difficulty_of(s) for s in order] == sorted(metrics.tolist())  # percentile order = ascending metric
    assert MMapIndexedDataset(index["index_to_sample"]).dtype is np.uint8  # 47 fits uint8
    assert MMapIndexedDataset(index["sample_to_metric"]).dtype is np.uint8


def test_analyzer_files_are_byte_identical_to_deepspeeds(index):
    for kind, (idx_hash, bin_hash) in DS_INDEX_SHA256.items():
        for ext, expected in (("idx", idx_hash), ("bin", bin_hash)):
            with open(f"{index[kind]}.{ext}", "rb") as handle:
                assert hashlib.sha256(handle.read()).hexdigest()[:16] == expected, f"{kind}.{ext}"


def test_analyzer_workers_and_accumulated_metric(tmp_path):
    """Two workers' maps (run separately, as on two nodes) reduce to the one-worker files; sums add up."""
    common = dict(num_workers=2, num_threads=2, batch_size=4, metric_names=[METRIC, "total"],
                  metric_functions=[difficulty_metric, lambda b: b[:, 1].sum().reshape(1)],
                  metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
                  metric_dtypes=[torch.int64, np.int64], save_path=str(tmp_path))
    for worker in (1, 0):
        DataAnalyzer(ToyDataset(), worker_id=worker, **common).run_map()
    DataAnalyzer(ToyDataset(), worker_id=0, num_threads_reduce=3, **common).run_reduce()
    prefix = os.path.join(str(tmp_path), METRIC, METRIC)
    assert _items(f"{prefix}_sample_to_metric") == [[difficulty_of(i)] for i in range(N)]
    assert _items(f"{prefix}_index_to_metric") == [[v] for v in range(1, 13)]
    assert _items(os.path.join(str(tmp_path), "total", "total_metric_value")) == [[sum(map(difficulty_of, range(N)))]]
    assert sorted(os.listdir(tmp_path / METRIC))[-4:] == ["worker0_thread0", "worker0_thread1", "worker1_thread0",
                                                          "worker1_thread1"]


def _distributed_analysis(save_path: str) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DistributedDataAnalyzer

    DistributedDataAnalyzer(ToyDataset(), num_workers=2, worker_id=dist.get_rank(), num_threads=1, batch_size=5,
                            metric_names=[METRIC, "total"],
                            metric_functions=[difficulty_metric, lambda b: b[:, 1].sum().reshape(1)],
                            metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
                            save_path=save_path, device="cpu").run_map_reduce()


def test_distributed_analyzer_on_two_ranks_writes_the_same_index(index, tmp_path):
    run_distributed(_distributed_analysis, world_size=2, args=(str(tmp_path),), timeout=60)
    prefix = os.path.join(str(tmp_path), METRIC, METRIC)
    for kind, reference in index.items():
        assert _items(f"{prefix}_{kind}") == _items(reference), kind
    assert _items(os.path.join(str(tmp_path), "total", "total_metric_value")) == [[sum(map(difficulty_of, range(N)))]]


def _two_values_per_sample(save_path: str) -> str:
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DistributedDataAnalyzer

    analyzer = DistributedDataAnalyzer(ToyDataset(), batch_size=5, metric_names=["pair"],
                                       metric_functions=[lambda b: b.clone()],  # [id, difficulty]: 2 per sample
                                       metric_types=["single_value_per_sample"], save_path=save_path, device="cpu")
    try:
        analyzer.run_map_reduce()
    except ValueError as err:
        return str(err)
    return "no error"


def test_distributed_analyzer_rejects_several_values_per_sample(tmp_path):
    message, = run_distributed(_two_values_per_sample, world_size=1, args=(str(tmp_path),), timeout=60)
    assert "'pair' is single_value_per_sample but its function returned 10 values for a batch of 5" in message


def test_analyzer_bad_input_is_named(tmp_path):
    kw = dict(metric_names=["m"], metric_functions=[difficulty_metric], metric_dtypes=[np.int64],
              save_path=str(tmp_path))
    with pytest.raises(ValueError, match="metric_type='per_token'; accepted: single_value_per_sample"):
        DataAnalyzer(ToyDataset(), metric_types=["per_token"], **kw)
    with pytest.raises(ValueError, match="worker_id=2 must be in"):
        DataAnalyzer(ToyDataset(), worker_id=2, metric_types=["single_value_per_sample"], **kw)
    wrong = DataAnalyzer(ToyDataset(), metric_types=["single_value_per_sample"],
                         **{**kw, "metric_dtypes": [np.int32]})
    with pytest.raises(TypeError, match="returned dtype torch.int64, but its metric_dtype is"):
        wrong.run_map()
    failing = DataAnalyzer(ToyDataset(), num_threads=2, metric_types=["single_value_per_sample"],
                           **{**kw, "metric_functions": [lambda b: 1 / 0]})
    with pytest.raises(RuntimeError, match="map thread 0: ZeroDivisionError"):
        failing.run_map()


# ---- DeepSpeedDataSampler ----------------------------------------------------------------------------------
def _sampler(config: dict, micro: int = 4, gas: int = 2, rank: int = 0, world: int = 1) -> DeepSpeedDataSampler:
    return DeepSpeedDataSampler(config, N, micro, rank, world, None, gas, rank)


def _walk(sampler: DeepSpeedDataSampler, count: int) -> list[tuple[int, int, list[int]]]:
    """``count`` micro batches with the curriculum step and difficulty they were drawn at."""
    out, it = [], iter(sampler)
    for _ in range(count):
        ids = next(it)
        out.append((sampler.curriculum_step, sampler.current_difficulties[METRIC], ids))
    return out


def _root(step: int, total: int, degree: float, low: int, high: int) -> int:
    return min(high, math.floor((step / total) ** (1 / degree) * (high - low) + low))


SCHEDULES = {
    "fixed_linear": ({"total_curriculum_step": 6, "difficulty_step": 1}, lambda t: _root(t, 6, 1, 3, 12)),
    "fixed_root": ({"total_curriculum_step": 6, "difficulty_step": 1, "root_degree": 2},
                   lambda t: _root(t, 6, 2, 3, 12)),
    "fixed_discrete": ({"difficulty": [4, 8, 12], "max_step": [2, 4]}, lambda t: 4 if t <= 2 else 8 if t <= 4 else 12),
}


@pytest.mark.parametrize("schedule_type", sorted(SCHEDULES))
def test_value_curriculum_batches_respect_the_schedule(index, tmp_path, schedule_type):
    schedule_config, expected = SCHEDULES[schedule_type]
    sampler = _sampler(data_efficiency(index, str(tmp_path), schedule_type=schedule_type,
                                       schedule_config=schedule_config))
    walked = _walk(sampler, 20)
    assert [step for step, _, _ in walked] == [1 + i // 2 for i in range(20)]  # a global batch = 2 micro batches
    for step, difficulty, ids in walked:
        assert difficulty == expected(step) and len(ids) == 4
        assert max(difficulty_of(i) for i in ids) <= difficulty, (step, ids)
    assert max(difficulty_of(i) for _, _, ids in walked[-6:] for i in ids) > 8  # hard samples arrive at the end
    clusters = sorted(os.listdir(tmp_path))
    assert f"cluster_{METRIC}{expected(1)}.idx" in clusters and f"cluster_{METRIC}12.bin" in clusters


@pytest.mark.parametrize("difficulty_type", ["value", "percentile"])
def test_sampler_draws_deepspeeds_batches(index, tmp_path, difficulty_type):
    extra = {"min_difficulty": 2, "max_difficulty": 24} if difficulty_type == "percentile" else {}
    sampler = _sampler(data_efficiency(index, str(tmp_path), difficulty_type=difficulty_type, **extra))
    assert [ids for _, _, ids in _walk(sampler, 16)] == DS_BATCHES[difficulty_type]


def test_percentile_curriculum_and_custom_schedule(index, tmp_path):
    """Percentile p of 24 admits the 2p easiest samples (index order); the custom function sets p per step."""
    config = data_efficiency({**index, "index_to_sample": index["index_to_sample_percentile_merged"]}, str(tmp_path),
                             difficulty_type="percentile", schedule_type="custom", min_difficulty=2,
                             max_difficulty=24)
    sampler = _sampler(config)
    sampler.set_custom_curriculum_learning_schedule({METRIC: lambda step: min(24, 2 + 4 * step)})
    order = [s for row in _items(index["index_to_sample"]) for s in row]
    for step, difficulty, ids in _walk(sampler, 12):
        assert difficulty == min(24, 2 + 4 * step)
        assert set(ids) <= set(order[:2 * difficulty]), (step, ids)
    with pytest.raises(ValueError, match=r"unknown metrics \['seqlen'\]"):
        sampler.set_custom_curriculum_learning_schedule({"seqlen": lambda step: 1})


def test_sampler_state_dict_resumes_exactly_through_a_checkpoint_file(index, tmp_path):
    config = data_efficiency(index, str(tmp_path), schedule_config={"total_curriculum_step": 3, "difficulty_step": 1})
    first = _sampler(config, micro=8, gas=1)
    it = iter(first)
    for _ in range(7):  # into the second pass over the first clusters: reshuffles happened
        next(it)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    expected = [next(it) for _ in range(12)]  # the original run goes on (and reshuffles further)
    resumed = _sampler(config, micro=8, gas=1)
    resumed.load_state_dict(state)
    assert [ids for _, _, ids in _walk(resumed, 12)] == expected
    assert resumed.current_difficulties == first.current_difficulties
    assert any("_pass" in name for name in resumed.data_cluster_paths)


def test_sampler_rejects_bad_settings(index, tmp_path):
    config = data_efficiency(index, str(tmp_path))
    with pytest.raises(ValueError, match=r"data_parallel_rank=2 must be in \[0, data_parallel_size=2\)"):
        _sampler(config, rank=2, world=2)
    off = {**config, "data_sampling": {"curriculum_learning": {"enabled": False}}}
    with pytest.raises(ValueError, match="curriculum_learning.enabled=true"):
        _sampler(off)


def _two_rank_batches(config: dict, micro: int, count: int) -> list[list[int]]:
    sampler = DeepSpeedDataSampler(config, N, micro, dist.get_rank(), 2, None, 2, dist.get_rank())
    mine = [ids for _, _, ids in _walk(sampler, count)]
    gathered = [None, None]
    dist.all_gather_object(gathered, mine)
    return [a + b for a, b in zip(*gathered, strict=True)]


def test_two_ranks_get_disjoint_halves_of_the_same_global_batch(index, tmp_path):
    config = data_efficiency(index, str(tmp_path / "two"))
    batches = run_distributed(_two_rank_batches, world_size=2, args=(config, 3, 8), timeout=60)
    assert batches[0] == batches[1]
    reference = _sampler(data_efficiency(index, str(tmp_path / "one")), micro=6, gas=2)
    assert batches[0] == [ids for _, _, ids in _walk(reference, 8)]  # one rank drawing 6 = two ranks drawing 3
    for whole in batches[0]:
        assert len(whole) == 6


def _cluster_paths_after(config: dict, count: int) -> list[str]:
    sampler = DeepSpeedDataSampler(config, N, 2, dist.get_rank(), 2, None, 1, dist.get_rank())
    _walk(sampler, count)
    return list(sampler.data_cluster_paths)


def test_ranks_agree_on_clusters_despite_a_stale_cluster_file(index, tmp_path):
    """Difficulty 12 -> 13 -> 14 admits no sample after 12 (the toy's values are 1..12): rank 0 writes no cluster
    for 13 or 14, and a stale ``cluster_difficulty14`` file left by an earlier run must not make rank 1 count one."""
    path = tmp_path / "stale"
    path.mkdir()
    for ext in ("bin", "idx"):
        (path / f"cluster_{METRIC}14.{ext}").write_bytes(b"")
    config = data_efficiency(index, str(path), min_difficulty=12, max_difficulty=14,
                             schedule_config={"total_curriculum_step": 2, "difficulty_step": 1})
    paths = run_distributed(_cluster_paths_after, world_size=2, args=(config, 4), timeout=60)
    assert paths[0] == paths[1] == [f"cluster_{METRIC}13"]

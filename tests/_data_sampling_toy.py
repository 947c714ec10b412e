"""A toy dataset with a known difficulty per sample, its DataAnalyzer index and curriculum configs (shared by the
data-sampling tests)."""

from __future__ import annotations

import os

import numpy as np
import torch

N = 48
METRIC = "difficulty"


def difficulty_of(i: int) -> int:
    """Sample ``i``'s difficulty: values 1..12, four samples each, scattered over the dataset."""
    return (i * 37) % 12 + 1


class ToyDataset(torch.utils.data.Dataset):
    """Sample ``i`` is ``[i, difficulty_of(i)]`` (int64)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, difficulty_of(i)], dtype=torch.long)


def difficulty_metric(batch: torch.Tensor) -> torch.Tensor:
    return batch[:, 1].clone()


def analyze(save_path: str, num_threads: int = 1, num_threads_reduce: int = 1) -> dict[str, str]:
    """Run the DataAnalyzer over the toy dataset; the index file prefixes of the difficulty metric."""
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer

    DataAnalyzer(ToyDataset(), num_threads=num_threads, num_threads_reduce=num_threads_reduce, batch_size=5,
                 metric_names=[METRIC], metric_functions=[difficulty_metric],
                 metric_types=["single_value_per_sample"], metric_dtypes=[np.int64],
                 save_path=save_path).run_map_reduce()
    prefix = os.path.join(save_path, METRIC, METRIC)
    return {kind: f"{prefix}_{kind}" for kind in ("sample_to_metric", "index_to_sample", "index_to_metric",
                                                  "index_to_sample_percentile_merged")}


def data_efficiency(index: dict[str, str], cluster_path: str, difficulty_type: str = "value",
                    schedule_type: str = "fixed_linear", schedule_config: dict | None = None,
                    min_difficulty: int = 3, max_difficulty: int = 12, seed: int = 1234) -> dict:
    """A ``data_efficiency`` section sampling the toy dataset by difficulty."""
    if schedule_config is None and schedule_type != "custom":
        schedule_config = {"total_curriculum_step": 6, "difficulty_step": 1}
    metric = {"index_to_sample_path": index["index_to_sample"], "index_to_metric_path": index["index_to_metric"],
              "difficulty_type": difficulty_type, "clustering_type": "schedule_based",
              "min_difficulty": min_difficulty, "max_difficulty": max_difficulty, "schedule_type": schedule_type}
    if schedule_config is not None:
        metric["schedule_config"] = schedule_config
    return {"enabled": True, "seed": seed,
            "data_sampling": {"enabled": True, "num_epochs": 4, "num_workers": 0,
                              "curriculum_learning": {"enabled": True, "data_cluster_path": cluster_path,
                                                      "curriculum_metrics": {METRIC: metric}}}}

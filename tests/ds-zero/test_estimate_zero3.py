"""The memory estimators on a model built under ``zero.Init``: its parameters hold empty tensors (``numel() == 0``)
and only their ``ds_numel`` / ``ds_shape`` say how large they are. The counts, the printed table and its rows must
be those of the same model built normally, in one process and on 2 gloo ranks (where each rank's partition holds
half of every parameter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

from ds_zero.estimate import (
    count_largest_layer_params,
    count_params,
    count_total_params,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_live,
    zero2_model_to_params,
    zero3_model_to_params,
)
from ds_zero.zero3 import Init, TiledLinear

VOCAB, DIM = 37, 12


class TiedNet(nn.Module):
    """Tied embedding/head (counted once), an odd-sized layer (padded partitions) and a tiled layer whose
    largest tile is smaller than the largest plain layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, 7)
        self.tiled = TiledLinear(7, DIM, in_splits=2, out_splits=3)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight


EXPECTED_TOTAL = VOCAB * DIM + (DIM * 7 + 7) + (7 * DIM + DIM)
EXPECTED_LARGEST = VOCAB * DIM  # the embedding (and, tied, the head): 444


def _figures(model: nn.Module) -> dict:
    rows3 = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=4, num_nodes=2,
                                                           additional_buffer_factor=1.25)
    rows2 = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=4, num_nodes=2)
    return {"counts": count_params(model), "z3": zero3_model_to_params(model), "z2": zero2_model_to_params(model),
            "rows3": rows3, "rows2": rows2, "tile": count_largest_layer_params(model.tiled)}


def test_zero_init_model_estimates_like_the_normal_model(capsys):
    torch.manual_seed(0)
    normal = TiedNet()
    with Init():
        partitioned = TiedNet()
    assert all(p.numel() == 0 and p.ds_numel > 0 for p in partitioned.parameters())  # the case under test
    want = _figures(normal)
    want_out = capsys.readouterr().out
    got = _figures(partitioned)
    assert got == want and capsys.readouterr().out == want_out
    assert got["z3"] == (EXPECTED_TOTAL, EXPECTED_LARGEST) and got["z2"] == EXPECTED_TOTAL
    # the largest tile: 4 of 12 outputs x 4 of 7 inputs (16), or x 3 inputs plus the row's 4 biases (16)
    assert got["tile"] == 16


def test_counts_follow_ds_shape_when_ds_numel_is_missing():
    """A partitioned parameter from another implementation may carry only ``ds_shape``."""
    holder = nn.Module()
    holder.w = nn.Parameter(torch.empty(0))
    holder.w.ds_shape = torch.Size([6, 5])
    holder.v = nn.Parameter(torch.empty(0))
    holder.v.ds_shape = torch.Size([3])
    assert count_total_params(holder) == 33 and count_largest_layer_params(holder) == 33


def _on_two_ranks() -> dict:
    torch.manual_seed(dist.get_rank())
    normal = TiedNet()
    with Init():
        partitioned = TiedNet()
    parts = {n: p.ds_tensor.numel() for n, p in partitioned.named_parameters()}
    return {"normal": _figures(normal), "partitioned": _figures(partitioned), "parts": parts,
            "empty": all(p.numel() == 0 for p in partitioned.parameters())}


def test_zero_init_model_on_two_ranks_estimates_like_the_normal_model():
    for rank in run_distributed(_on_two_ranks, world_size=2, timeout=60):
        # each rank holds ceil(numel / 2) of a parameter: counting partitions would give about half
        assert rank["empty"] and rank["parts"]["embed.weight"] == VOCAB * DIM // 2
        assert rank["parts"]["mid.bias"] == 4  # 7 elements padded to 8
        assert rank["partitioned"] == rank["normal"]
        assert rank["partitioned"]["z3"] == (EXPECTED_TOTAL, EXPECTED_LARGEST)

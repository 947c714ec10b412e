"""AutoTP layers built by hand with DeepSpeed's arguments, ``LinearLayer(module, tp_group, gather_output=True)``
and ``LinearAllreduce(module, tp_group)``: without a layout they split as DeepSpeed's ``get_shard_size_list``
(near-even, larger shards first) and compute what the unsharded layer computes, gradients included."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from _harness import run_distributed


def _body() -> dict:
    from ds_inference.autotp import LinearAllreduce, LinearLayer

    rank = dist.get_rank()
    torch.manual_seed(0)
    column, row = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)  # 5 features over 2 ranks: [3, 2]
    x = torch.randn(2, 4)
    out = {}
    col = LinearLayer(copy.deepcopy(column), None, gather_output=True)
    y = col(x)
    y.sum().backward()
    column(x).sum().backward()
    out["col"] = (tuple(col.weight.shape), torch.allclose(y, column(x).detach(), atol=1e-6),
                  torch.allclose(col.weight.grad, column.weight.grad[[0, 1, 2] if rank == 0 else [3, 4]]))
    rows = LinearAllreduce(copy.deepcopy(row), None)
    h = torch.randn(2, 5)
    mine = h[:, :3] if rank == 0 else h[:, 3:]
    out["row"] = (tuple(rows.weight.shape), torch.allclose(rows(mine), row(h).detach(), atol=1e-6))
    return out


def test_layers_built_with_deepspeeds_arguments_split_like_get_shard_size_list():
    r0, r1 = run_distributed(_body, world_size=2, timeout=60)
    assert r0["col"] == ((3, 4), True, True) and r1["col"] == ((2, 4), True, True)
    assert r0["row"] == ((3, 3), True) and r1["row"] == ((3, 2), True)


def _hooks_body() -> dict:
    from ds_inference.autotp import LinearAllreduce, LinearLayer

    torch.manual_seed(0)
    column, row = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)
    out = {}
    for kind, layer, source in (("col", LinearLayer(copy.deepcopy(column), None), column),
                                ("row", LinearAllreduce(copy.deepcopy(row), None), row)):
        shards = {n: p.detach().clone() for n, p in layer.named_parameters()}
        hooked = [n for n, p in layer.named_parameters() if hasattr(p, "gather_params")]
        for name in hooked:  # DeepSpeed's per-parameter calls, one parameter at a time
            param = getattr(layer, name)
            param.gather_params([param])
        full = all(torch.equal(getattr(layer, n), getattr(source, n)) for n in ("weight", "bias"))
        for name in hooked:
            param = getattr(layer, name)
            param._tp_partition([param])
        back = all(torch.equal(p, shards[n]) for n, p in layer.named_parameters())
        out[kind] = (sorted(hooked), full, back, layer.weight.ds_is_replaced_module)
    return out


def test_sliced_parameters_carry_deepspeeds_gather_and_partition_hooks():
    """``param.gather_params([param])`` makes a sliced parameter whole (the uneven 5-wide split too) and
    ``param._tp_partition([param])`` cuts it back to the same shard; a row-parallel bias is replicated: no hooks."""
    for result in run_distributed(_hooks_body, world_size=2, timeout=60):
        assert result["col"] == (["bias", "weight"], True, True, True)
        assert result["row"] == (["weight"], True, True, True)

"""ZeRO-3 internals DeepSpeed's tests reach: ``param.all_gather_coalesced(params)`` (an asynchronous gather of
several parameters, a handle with ``wait()``) brings back the exact whole values, padded partitions included;
DeepSpeed's names for the unwrapped tensor constructors are torch's own (``Init`` never wraps them here); the
optimizer's ``_get_norm_groups()`` combine to the step's global norm (``_global_grad_norm``)."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed


def _gather_body() -> dict:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    numels = (3, 5, 8)  # 3 and 5 leave padding in the last rank's partition
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        module = torch.nn.ParameterList([torch.nn.Parameter(torch.arange(1.0, n + 1)) for n in numels])
    params = list(module)
    before = [p.ds_status for p in params]
    handle = params[0].all_gather_coalesced(params)
    handle.wait(handle_dependency=False)
    again = params[0].all_gather_coalesced(params)  # all available now: nothing to gather
    again.wait()
    with pytest.raises(ValueError, match="quantize=True"):
        params[0].all_gather_coalesced(params, quantize=True)
    return {"before": [s is ZeroParamStatus.NOT_AVAILABLE for s in before],
            "after": [p.ds_status is ZeroParamStatus.AVAILABLE for p in params],
            "exact": [torch.equal(p.data, torch.arange(1.0, n + 1)) for p, n in zip(params, numels, strict=True)]}


def test_all_gather_coalesced_reconstructs_padded_partitions_exactly():
    for out in run_distributed(_gather_body, world_size=2, timeout=120):
        assert out == {"before": [True] * 3, "after": [True] * 3, "exact": [True] * 3}


def test_unwrapped_constructor_names_are_torchs():
    from deepspeed.runtime.zero import partition_parameters as pp

    assert (pp._orig_torch_empty, pp._orig_torch_zeros, pp._orig_torch_arange) == (torch.empty, torch.zeros,
                                                                                   torch.arange)


def _norm_groups_body() -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "sub_group_size": 10},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
    x = torch.randn(2, 6) + torch.distributed.get_rank()
    engine.backward(engine(x).pow(2).sum())
    groups = optimizer._get_norm_groups()
    total = float(torch.linalg.vector_norm(torch.stack(groups)))
    engine.step()
    return {"groups": len(groups), "total": total, "step": float(optimizer._global_grad_norm)}


def test_norm_groups_combine_to_the_steps_global_norm():
    outs = run_distributed(_norm_groups_body, world_size=2, timeout=120)
    assert outs[0]["groups"] > 1  # several sub-groups
    for out in outs:
        assert out["total"] == pytest.approx(outs[0]["step"], rel=1e-5)
        assert out["step"] == outs[0]["step"]

"""AutoTP with ZeRO-3 (each tensor shard partitioned over its data-parallel group) trains step for step as AutoTP
with ZeRO-0, bitwise; and the first forward refuses inputs that differ within a tensor group, on every rank."""

from __future__ import annotations

from _harness import run_distributed

SPECS = {"layer_specs": [{"patterns": [r"^0\.weight$", r"^0\.bias$"], "partition_type": "column"},
                         {"patterns": [r"^2\.weight$"], "partition_type": "row"}]}


def _engine(stage: int):
    import torch

    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "tensor_parallel": {"autotp_size": 2, "partition_config": SPECS}, "zero_optimization": {"stage": stage}}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def _losses(stage: int) -> list[float]:
    import torch
    import torch.distributed as dist

    engine = _engine(stage)
    data = torch.Generator().manual_seed(dist.get_rank() // 2)  # one stream per tensor group
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(2, 16, generator=data)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_autotp_zero3_trains_as_zero0():
    zero0 = run_distributed(_losses, 4, args=(0,), timeout=120)
    zero3 = run_distributed(_losses, 4, args=(3,), timeout=120)
    assert zero3 == zero0
    assert zero0[0] == zero0[1] and zero0[0] != zero0[2]  # tensor groups agree, data groups see other data


def _mismatch() -> tuple[str, bool]:
    import torch
    import torch.distributed as dist

    engine = _engine(0)
    try:
        engine(torch.full((2, 16), float(dist.get_rank())))
    except AssertionError as exc:
        message = str(exc)
    same = torch.full((2, 16), float(dist.get_rank() // 2))  # equal within each tensor group: passes
    return message, engine(same).shape == (2, 16)


def test_first_forward_checks_inputs_across_the_tensor_group():
    for message, passed in run_distributed(_mismatch, 4, timeout=120):
        assert message.startswith("Data inconsistency within the TP group") and passed


def _consolidated() -> bool | None:
    import torch

    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).state_dict()
    state = _engine(0)._consolidated_16bit_state_dict()  # same seed: the engine's model starts as `whole`
    if state is None:
        return None
    return state.keys() == whole.keys() and all(torch.equal(state[k], whole[k]) for k in whole)


def test_autotp_consolidated_state_dict_is_rank0s_only():
    assert run_distributed(_consolidated, 2, timeout=120) == [True, None]

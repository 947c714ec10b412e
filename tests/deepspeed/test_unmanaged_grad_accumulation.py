"""``"managed_gradient_accumulation": false``: every ``step()`` is the accumulation boundary, however many backward
calls came before it. The update equals plain torch's (SGD over the mean of every rank's micro-batches) and the
managed engine's with the same boundaries set by hand, at every ZeRO stage; misuse is refused as DeepSpeed does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

COUNTS = (2, 3, 1)  # backward calls per step: differ from each other and from gradient_accumulation_steps
GAS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _config(stage: int, managed: bool) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
            "managed_gradient_accumulation": managed, "zero_optimization": zero,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True}


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 4, generator=gen) for _ in range(sum(COUNTS))]  # 2 samples per rank each


def _train(stage: int, managed: bool) -> tuple[list[torch.Tensor], list[bool], list[int]]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    rank = dist.get_rank()
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage, managed))
    assert engine.managed_gradient_accumulation() is managed
    batches = iter(_batches())
    applied, samples = [], []
    for n in COUNTS:
        for i in range(n):
            if managed:
                engine.set_gradient_accumulation_boundary(i == n - 1)
            else:
                assert not engine.is_gradient_accumulation_boundary()
            x = next(batches)[2 * rank:2 * rank + 2]
            engine.backward(engine(x).pow(2).mean() / n, scale_wrt_gas=False)
        engine.step()
        applied.append(engine.was_step_applied())
        samples.append(engine.global_samples)
    # stage 0 fp32 keeps no separate master: the module's parameters are the weights
    params = [p.detach().clone() if stage == 0 else safe_get_full_fp32_param(p).clone()
              for p in engine.module.parameters()]
    engine.destroy()
    return params, applied, samples


def _reference() -> list[torch.Tensor]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = iter(_batches())
    for n in COUNTS:
        for _ in range(n):
            x = next(batches)
            for rank in range(2):  # the mean over the ranks and over the caller's n micro-batches
                (model(x[2 * rank:2 * rank + 2]).pow(2).mean() / (2 * n)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_step_updates_as_the_caller_counted(stage):
    unmanaged = run_distributed(_train, world_size=2, args=(stage, False), timeout=240)
    managed = run_distributed(_train, world_size=2, args=(stage, True), timeout=240)
    want = _reference()
    for rank in range(2):
        params, applied, samples = unmanaged[rank]
        assert applied == [True] * len(COUNTS)
        # 2 ranks x 2 samples per micro-batch, counted per backward call (not train_batch_size = 16 per step)
        assert samples == [4 * 2, 4 * 5, 4 * 6]
        for have, ref, same in zip(params, want, managed[rank][0], strict=True):
            torch.testing.assert_close(have, ref, rtol=1e-5, atol=1e-6)
            assert torch.equal(have, same), f"stage {stage}: unmanaged differs from managed with the same boundaries"


def _misuse(stage: int) -> list[str]:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage, False))
    caught = []
    with pytest.raises(AssertionError, match="set_gradient_accumulation_boundary") as err:
        engine.set_gradient_accumulation_boundary(True)
    caught.append(str(err.value))
    if stage in (1, 2):
        with pytest.raises(AssertionError, match="coalesce_grad_reduction"), engine.coalesce_grad_reduction():
            pass
    engine.destroy()
    config = _config(stage, False)
    config["zero_optimization"]["overlap_comm"] = True
    if stage < 2:
        from ds_config import ConfigError

        with pytest.raises(ConfigError, match="overlap_comm only with ZeRO stage 2") as err:
            deepspeed.initialize(model=_model(), config=config)
        assert isinstance(err.value, AssertionError) and "zero_optimization.overlap_comm" in str(err.value)
    else:
        deepspeed.initialize(model=_model(), config=config)[0].destroy()
    return caught


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_calls_that_move_the_boundary_are_refused(stage):
    ((message,),) = run_distributed(_misuse, world_size=1, args=(stage,), timeout=180)
    assert "managed_gradient_accumulation=False" in message

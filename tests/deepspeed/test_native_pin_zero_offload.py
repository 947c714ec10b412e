"""ZeRO CPU optimizer offload with ``pin_memory: true`` under ``DS_PIN_MEMORY_BACKEND=native``: the offloaded
masters are pinned through the accelerator (so the native manager tracks them) and ``engine.destroy()`` frees
them; training is bitwise the same as with torch pinning (a no-op on a CPU-only host)."""

from __future__ import annotations

import os

import pytest
import torch
from _harness import run_distributed

from ds_zero.host_pinning import TORCH_PINNING, HostPinning, PinnedBuffers


def _train(stage: int, backend: str) -> tuple[int, int, int, dict[str, torch.Tensor]]:
    """(pinned buffers after 3 steps, after destroy, masters pinned by the engine, the trained weights)."""
    import deepspeed
    from deepspeed.utils.pin_memory import get_native_pinned_memory

    os.environ["DS_PIN_MEMORY_BACKEND"] = backend
    pins = get_native_pinned_memory()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
              "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    held = len(engine.optimizer._pinned._held)
    during = len(pins._ranges)
    with deepspeed.zero.GatheredParameters(list(model.parameters())) if stage == 3 else _nothing():
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.destroy()
    return during, len(pins._ranges), held, weights


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _both_backends(stage: int) -> list:
    return [_train(stage, "torch"), _train(stage, "native")]


@pytest.mark.parametrize("stage", [2, 3])
def test_native_backend_pins_offloaded_masters_and_destroy_frees_them(stage):
    (torch_run, native_run), = run_distributed(_both_backends, world_size=1, args=(stage,), timeout=120)
    during, after, held, weights = native_run
    assert held > 0 and during >= held, "the offloaded masters were not pinned through the native manager"
    assert after == 0, f"destroy() left {after} native pinned buffers"
    assert torch_run[:3] == (0, 0, 0)  # torch pinning: nothing tracked, nothing held (no CUDA here)
    assert weights.keys() == torch_run[3].keys()
    for name, value in weights.items():
        assert torch.equal(value, torch_run[3][name]), name


def test_pinned_buffers_hold_and_free_only_what_the_backend_must_free():
    freed: list[torch.Tensor] = []
    cpu, other = torch.ones(3), torch.ones(3, device="meta")
    tracked = PinnedBuffers(HostPinning(pin=lambda t: t.clone(), unpin=freed.append))
    pinned = tracked.pin(cpu)
    assert pinned is not cpu and torch.equal(pinned, cpu) and tracked.pin(other) is other
    tracked.release()
    assert len(freed) == 1 and freed[0] is pinned
    tracked.release()  # released once only
    assert len(freed) == 1
    default = PinnedBuffers(TORCH_PINNING)
    kept = default.pin(cpu)
    assert (kept is cpu) == (not torch.cuda.is_available()) and default._held == []

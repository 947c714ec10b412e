"""ZeRO stages 1 and 2 expose each parameter group's flat weight buffer under DeepSpeed's name
(``bit16_groups_flat``): the tensor the model's parameters are views of, not a copy, padded to ``2 * world``
elements and detached from autograd; and log how it was flattened, in DeepSpeed's words, on DeepSpeed's logger."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _config(stage: int, dtype: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _flat_body(stage: int, dtype: str, starve: bool) -> dict:
    import deepspeed
    import ds_zero._flat_group as flat_group

    probe = flat_group.free_memory_bytes
    if starve:  # no room on the device for the flat buffer: the CPU-staging path
        flat_group.free_memory_bytes = lambda device: 0
    records = _Records()
    logging.getLogger("DeepSpeed").addHandler(records)
    try:
        model = _model()
        engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage, dtype))
    finally:
        logging.getLogger("DeepSpeed").removeHandler(records)
        flat_group.free_memory_bytes = probe  # the worker runs other tests next
    opt = engine.optimizer
    flats = opt.bit16_groups_flat
    params = [p for p in model.parameters()]
    (flat,) = flats
    out = {"log": [m for m in records.messages if m.startswith("Flattening param group")],
           "numel": flat.numel(), "grad_fn": flat.grad_fn is None, "dtype": str(flat.dtype),
           "total": sum(p.numel() for p in params)}
    # every parameter is a view of the flat buffer: same storage, and a write through the buffer is seen
    out["views"] = all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)
    with torch.no_grad():
        flat[0] += 1.0
    out["write_seen"] = bool(params[0].reshape(-1)[0] == flat[0])
    with torch.no_grad():
        flat[0] -= 1.0
    x = torch.randn(2, 5, dtype=flat.dtype)
    for _ in range(2):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    # after steps (update + all-gather into the buffer) the parameters still read the same buffer
    out["after_step"] = torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), flat[:out["total"]])
    out["same_object"] = engine.optimizer.bit16_groups_flat[0] is flat
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    out["ranks_agree"] = all(torch.equal(g, flat) for g in gathered)
    return out


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bit16_groups_flat_is_the_parameters_buffer(stage, dtype):
    results = run_distributed(_flat_body, world_size=2, args=(stage, dtype, False), timeout=120)
    for r in results:
        assert r["log"] == ["Flattening param group 0 on cpu (sufficient memory)"]
        assert r["numel"] % 4 == 0 and r["total"] <= r["numel"] < r["total"] + 4
        assert r["dtype"] == ("torch.bfloat16" if dtype == "bf16" else "torch.float32")
        assert r["grad_fn"] and r["views"] and r["write_seen"] and r["after_step"] and r["same_object"]
        assert r["ranks_agree"]


def test_flatten_without_room_stages_on_cpu():
    (r,) = run_distributed(_flat_body, world_size=1, args=(2, "fp32", True), timeout=120)
    assert r["log"] == ["Flattening param group 0 on CPU (insufficient memory)"]
    assert r["views"] and r["write_seen"] and r["after_step"]


def test_flatten_without_room_matches_flatten_on_device():
    """The CPU-staging path lays out the same buffer with the same values as flattening in place."""
    from ds_zero._flat_group import FlatGroup

    def flat_of(starve: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
        import ds_zero._flat_group as flat_group

        if starve:
            monkeypatch.setattr(flat_group, "free_memory_bytes", lambda device: 0)
        params = list(_model().parameters())
        fg = FlatGroup(params, [str(i) for i in range(len(params))], 2, 0, torch.float32, torch.device("cpu"))
        monkeypatch.undo()
        return fg.lp_flat, fg.flattened_on_device

    with pytest.MonkeyPatch.context() as mp:
        staged, on_device_a = flat_of(True, mp)
    with pytest.MonkeyPatch.context() as mp:
        direct, on_device_b = flat_of(False, mp)
    assert (on_device_a, on_device_b) == (False, True)
    assert torch.equal(staged, direct)


def test_cpu_free_memory_is_known_and_plausible():
    from ds_zero._flat_group import free_memory_bytes

    free = free_memory_bytes(torch.device("cpu"))
    assert isinstance(free, int) and 0 < free
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert free <= total

"""ZeRO-3 gathers reuse their buffers (``ds_zero.zero3.gather_pool``) without changing a single bit.

A released parameter's whole value goes back to a pool and the next gather of the same size overwrites it. The
plain reference allocates every gather afresh (``set_enabled(False)``). On 2 gloo ranks, each case trains a few
steps through ``deepspeed.initialize`` (GAS 1 and 2, prefetch on and off, overlapped reduction on and off, fp32 and
bf16) and compares every loss and the final weights, exactly, with the reference, twice (the second pooled run
starts from a pool the first one filled). Once the pool has settled (the first step records the prefetch trace, the
next ones replay it), a pooled step allocates no gather buffer at all, unless the pass releases every module as it
goes (then one buffer of every size would outgrow the pool's bound, a quarter above the most ever gathered at
once). And a buffer something still refers to (a view kept past the release) is never handed to another gather.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from _harness import run_distributed

STEPS, MICRO, WIDTH = 4, 4, 96  # a 96 x 96 weight: 4,608 elements per rank (packed); 288 x 288: direct
CASES = {
    "prefetch": {},
    "no_prefetch": {"stage3_prefetch_bucket_size": 0},
    "no_overlap": {"overlap_comm": False},
    "release_every_module": {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0},
}


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 288))
        self.big = torch.nn.Sequential(torch.nn.Linear(288, 288), torch.nn.GELU(), torch.nn.Linear(288, 288))
        self.head = torch.nn.Linear(288, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.big(self.small(x)))


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train(zero: dict, gas: int, bf16: bool) -> dict:
    import deepspeed
    from ds_zero.zero3 import GatheredParameters
    from ds_zero.zero3.gather_pool import fresh_buffers

    torch.manual_seed(0)
    model = _Net()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
              "gradient_clipping": 0.5, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                                                               **zero},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    dtype = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, fresh = [], []
    for _ in range(STEPS * gas):
        x = torch.randn(MICRO, WIDTH, generator=gen).to(dtype)
        loss = (engine(x).float() - 1.0).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        fresh.append(fresh_buffers())
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        weights = _digest(params)
    engine.destroy()
    return {"losses": losses, "weights": weights, "fresh": fresh,
            "fresh_last_step": fresh[-1] - fresh[-1 - gas]}


def _cases(bf16: bool) -> dict:
    from ds_zero.zero3.gather_pool import set_enabled

    out = {}
    try:
        for pooled, run in ((False, 0), (True, 0), (True, 1)):
            set_enabled(pooled)
            for gas in (1, 2):
                for name, zero in CASES.items():
                    out[pooled, run, gas, name] = _train(zero, gas, bf16)
    finally:
        set_enabled(True)
    return out


def _check(results: list[dict]) -> None:
    for key, got in results[0].items():
        assert all(got["weights"] == r[key]["weights"] for r in results[1:]), key  # ranks agree
        pooled, _, gas, name = key
        want = results[0][False, 0, gas, name]
        assert got["losses"] == want["losses"], key
        assert got["weights"] == want["weights"], key
        if pooled and name != "release_every_module":  # a few steps settle the pool; then a step allocates nothing
            assert got["fresh_last_step"] == 0, (key, got["fresh"])


def test_pooled_gathers_train_bit_exactly_like_fresh_ones_fp32():
    _check(run_distributed(_cases, world_size=2, args=(False,), timeout=240))


def test_pooled_gathers_train_bit_exactly_like_fresh_ones_bf16():
    _check(run_distributed(_cases, world_size=2, args=(True,), timeout=240))


def _held_view_survives() -> list[float]:
    """Two same-shape layers share a pool size. The first one's forward keeps a view of its weight beyond its
    release; the second's gather must not take that memory."""
    import deepspeed
    from ds_zero.zero3.gather_pool import pooled_bytes

    class Keeper(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.kept = self.weight.detach()[0]  # shares the gathered buffer's memory
            self.value = self.kept.clone()
            return super().forward(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Keeper(288, 288), torch.nn.Linear(288, 288))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0,
                                    "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    with torch.no_grad():
        for _ in range(3):
            engine(torch.randn(2, 288))
    keeper = engine.module[0]
    out = [float((keeper.kept - keeper.value).abs().max()), float(pooled_bytes() > 0)]
    engine.destroy()
    return out


def test_a_buffer_still_referred_to_is_never_reused():
    for diff, pooled in run_distributed(_held_view_survives, world_size=2, timeout=120):
        assert diff == 0.0
        assert pooled == 1.0  # the pool was in use: the other layer's buffer went back to it

"""ZeRO-Infinity's optimizer on NVMe equals ``offload_optimizer: cpu`` bit for bit (issue 25): 2 gloo ranks, an
MLP of Linear(64, 64) layers, stage 3, DeepSpeedCPUAdam (AdamW), GAS 2, fp32, every step's losses and the final
parameters compared with ``==``/``torch.equal``, over 12 runs with a random delay injected before every swap
transfer (``DS_SWAP_IO_JITTER_MS``, so the orderings of reads, writes and steps vary), pipelining on and off,
``ratio`` < 1, several sub-groups, parameters in CPU memory and on NVMe. Then the buffer ownership rule of
``ds_zero.swap.buffer_pool``: a buffer used, reused or given back while its transfer is in flight is an error,
and the test-only jitter handle delays the transfer itself."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_ops.aio import AioError, AsyncIOHandle
from ds_zero.swap import BufferPool, OptimizerSwapper, OptimizerSwapSettings, ParamSwapper, ParamSwapSettings
from ds_zero.swap._jitter import JITTER_ENV, SEED_ENV, JitterHandle, jitter_ms
from ds_zero.swap.buffer_pool import BufferInFlightError

STEPS, MICRO, GAS, WIDTH = 4, 4, 2, 64
# per run: (offload_optimizer extras, parameters on NVMe); cycled over the repeats
VARIANTS = [
    ({"pipeline_read": True, "pipeline_write": True, "buffer_count": 8}, False),
    ({"pipeline_read": False, "pipeline_write": False, "buffer_count": 4, "fast_init": True}, False),
    ({"pipeline_read": True, "pipeline_write": False, "buffer_count": 5, "ratio": 0.5}, False),
    ({"pipeline_read": False, "pipeline_write": True, "buffer_count": 6, "ratio": 0.7}, True),
]
REPEATS = 12


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())])


def _train(path: str, optimizer_nvme: dict | None, params_nvme: bool) -> tuple[list[list[float]], list, int]:
    """Losses of every micro-batch of every step (both ranks'), the final full parameters, swapped sub-groups."""
    import deepspeed

    model = _model()
    off = {"device": "cpu"} if optimizer_nvme is None else {"device": "nvme", "nvme_path": path, **optimizer_nvme}
    param = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0, "buffer_count": 6, "buffer_size": 4096} \
        if params_nvme else {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "offload_optimizer": off, "offload_param": param,
                                    "sub_group_size": 1500, "stage3_param_persistence_threshold": 0},
              "aio": {"block_size": 4096, "queue_depth": 2, "thread_count": 2}}
    engine = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())[0]
    assert type(engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    rank, losses = dist.get_rank(), []
    for step in range(STEPS):
        mine = []
        for micro in range(GAS):
            gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, y = torch.randn(MICRO, WIDTH, generator=gen), torch.randn(MICRO, WIDTH, generator=gen)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            mine.append(loss.detach())
        both = torch.stack(mine)
        gathered = [torch.empty_like(both) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, both)
        losses.append(torch.cat(gathered).tolist())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    swapped = len(engine.optimizer.swapped)
    engine.destroy()
    return losses, params, swapped


def _repeated_runs(path: str) -> dict:
    rank = dist.get_rank()
    reference = {nvme_params: _train(path, None, nvme_params) for nvme_params in (False, True)}
    initial = list(_model().parameters())
    trained = [not torch.equal(a, b) for a, b in zip(reference[False][1], initial, strict=True)]
    out = {"mismatch": [], "swapped": set(), "trained": all(trained)}
    for r in range(REPEATS):
        extra, nvme_params = VARIANTS[r % len(VARIANTS)]
        os.environ[SEED_ENV] = str(100 * r + rank)  # the delays differ per run and rank (the threads' timing too)
        losses, params, swapped = _train(path, extra, nvme_params)
        out["swapped"].add(swapped)
        want_losses, want_params, _ = reference[nvme_params]
        steps = [s for s in range(STEPS) if losses[s] != want_losses[s]]
        tensors = [k for k, (a, b) in enumerate(zip(params, want_params, strict=True)) if not torch.equal(a, b)]
        if steps or tensors:
            out["mismatch"].append({"run": r, "variant": r % len(VARIANTS), "steps": steps, "params": tensors})
    return out


def test_nvme_optimizer_equals_cpu_offload_bitwise_under_io_jitter(tmp_path, monkeypatch):
    monkeypatch.setenv(JITTER_ENV, "1.5")  # up to 1.5 ms before each swap transfer starts
    results = run_distributed(_repeated_runs, world_size=2, args=(str(tmp_path),), timeout=600)
    for r in results:
        assert r["trained"]
        assert r["mismatch"] == []
        assert max(r["swapped"]) >= 3 and min(r["swapped"]) < max(r["swapped"])  # several sub-groups; ratio < 1
    assert os.listdir(tmp_path) == []  # every swap folder removed on destroy


# ---- the ownership rule ----------------------------------------------------------------------------------------
def test_pool_refuses_a_buffer_whose_transfer_was_not_waited_for():
    pool = BufferPool(2, 16, torch.float32, key="offload_optimizer.buffer_count")
    reader, writer = object(), object()
    a = pool.get()
    view = a.narrow(0, 4, 8)
    pool.begin(view, reader, "read of 0_master.tensor.swp")
    assert pool.in_flight == 1
    for act in (lambda: pool.put(a), lambda: pool.check_ready([a.narrow(0, 0, 2)]),
                lambda: pool.begin(a, writer, "write of 0_master.tensor.swp")):
        with pytest.raises(BufferInFlightError, match=r"read of 0_master.tensor.swp is in flight.*wait\(\)"):
            act()
    pool.settle(writer)  # another handle's wait does not cover it
    with pytest.raises(BufferInFlightError):
        pool.put(a)
    pool.settle(reader)
    pool.check_ready([view, torch.zeros(3)])  # memory outside the pool is not the pool's business
    pool.put(a)
    with pytest.raises(BufferInFlightError, match="in the pool"):
        pool.begin(a, reader, "read of x")  # a free buffer is nobody's to transfer
    with pytest.raises(BufferInFlightError, match="given back"):
        pool.check_ready([a])
    b = pool.get()
    pool.begin(b, writer, "write of y")
    pool.reclaim()  # after a failure, every handle waited for
    assert pool.free == 2 and pool.in_flight == 0


def _swapper(tmp_path, **kw: object) -> OptimizerSwapper:
    settings = OptimizerSwapSettings(nvme_path=str(tmp_path), aio={"block_size": 4096, "queue_depth": 2}, **kw)
    swapper = OptimizerSwapper(settings, rank=0, largest_numel=64)
    swapper.init_masters((i, lambda i=i: torch.full((64,), float(i))) for i in range(3))
    return swapper


def test_step_never_sees_a_buffer_whose_read_was_not_waited_for(tmp_path, monkeypatch):
    swapper = _swapper(tmp_path, buffer_count=6, pipeline_read=True, pipeline_write=True)
    seen = []
    swapper.run([0, 1, 2], lambda i, t: seen.append(float(t["master"][0])) or {"master": t["master"].add_(1)})
    assert seen == [0.0, 1.0, 2.0] and swapper.pool.free == 6 and swapper.pool.in_flight == 0
    real_wait = swapper._wait
    monkeypatch.setattr(swapper, "_wait", lambda handle, what, write: None if handle is swapper.reader
                        else real_wait(handle, what, write))  # a swapper that "forgets" the reader's wait
    with pytest.raises(BufferInFlightError, match=r"cannot use it while its read of 0_master.tensor.swp"):
        swapper.run([0, 1, 2], lambda i, t: {"master": t["master"]})
    assert swapper.pool.free == 6 and swapper.pool.in_flight == 0  # the failed run drained and reclaimed
    monkeypatch.setattr(swapper, "_wait", real_wait)
    swapper.run([0, 1, 2], lambda i, t: {"master": t["master"].add_(1)})
    assert [float(swapper.read_new(i)["master"][0]) for i in range(3)] == [2.0, 3.0, 4.0]
    swapper.close()


def test_step_returning_a_buffer_in_flight_is_an_error(tmp_path):
    swapper = _swapper(tmp_path, buffer_count=4, pipeline_read=True, pipeline_write=True)
    held = {}

    def step(i: int, tensors: dict) -> dict:
        if i == 1:  # sub-group 1 returns, as its master, a buffer being written back for sub-group 0
            return {"master": held[0]}
        held[i] = tensors["master"]
        return {"master": tensors["master"]}

    # by then sub-group 0's write was waited for and its buffer given back: not sub-group 1's to write from
    with pytest.raises(BufferInFlightError, match="write of 1_master.tensor.swp on a buffer that is in the pool"):
        swapper.run([0, 1, 2], step)
    swapper.close()


def test_param_buffer_in_flight_cannot_go_back(tmp_path):
    swapper = ParamSwapper(ParamSwapSettings(nvme_path=str(tmp_path), buffer_count=2, buffer_size=32, max_in_cpu=0,
                                             aio={"block_size": 4096}), rank=0)
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_id, p.ds_shape, p.ds_tensor = 7, (32,), torch.arange(32, dtype=torch.float32)
    swapper.adopt(p)
    assert swapper.prefetch([p]) == 1
    pool = swapper._pools[torch.float32]
    _, buffer = swapper.reading[7]
    with pytest.raises(BufferInFlightError, match="read of parameter partition 7"):
        pool.put(buffer)
    swapper.swap_in([p])  # waits for the read: now resident, its buffer owned and ready
    assert torch.equal(p.ds_tensor, torch.arange(32, dtype=torch.float32))
    swapper.release([p])
    assert pool.free == 2 and pool.in_flight == 0
    swapper.close()


# ---- the test-only jitter --------------------------------------------------------------------------------------
def test_jitter_delays_the_transfer_itself_and_wait_covers_it(tmp_path, monkeypatch):
    path = str(tmp_path / "t.swp")
    handle = JitterHandle(AsyncIOHandle(block_size=4096, backend="threads"), max_delay_s=0.002, seed=3)
    handle.sync_pwrite(torch.zeros(1024), path)
    monkeypatch.setattr(handle, "_delay", lambda: 0.5)  # a delay far beyond the next two lines' time
    into = torch.full((1024,), -1.0)
    handle.async_pread(into, path)
    assert handle.pending() == 1 and bool((into == -1).all())  # the transfer has not even started
    assert handle.wait() == 1 and torch.equal(into, torch.zeros(1024)) and handle.pending() == 0
    monkeypatch.undo()
    handle.async_pread(torch.empty(4), str(tmp_path / "missing.swp"))  # refused when it reaches the handle ...
    with pytest.raises(AioError, match="does not exist"):
        handle.wait()  # ... and reported by the wait, as the real handle's errors are
    handle.close()


def test_jitter_setting(monkeypatch):
    monkeypatch.delenv(JITTER_ENV, raising=False)
    assert jitter_ms() == 0.0
    monkeypatch.setenv(JITTER_ENV, "2.5")
    assert jitter_ms() == 2.5
    monkeypatch.setenv(JITTER_ENV, "fast")
    with pytest.raises(ValueError, match=f"{JITTER_ENV}='fast'.*milliseconds >= 0"):
        jitter_ms()

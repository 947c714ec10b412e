"""ZeRO-Infinity (stage 3 with ``offload_optimizer``/``offload_param`` on NVMe, here a temp dir) on 2 gloo ranks:
the same losses as stage 3 in memory (fp32, 1e-6), an exact resume from its checkpoint, that checkpoint loading
into an in-memory run, partial offload (``ratio``), swap files per rank removed on destroy, and the failures
(missing or unwritable ``nvme_path``, a truncated swap file, ``use_gds``) as errors naming the path and the op."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from _zero3_toy import GLOBAL, TiedNet
from _zero3_toy import INFINITY_ZERO as ZERO
from _zero3_toy import train_step as _step


def _nvme(path: str, param: dict | None = None, **optimizer: object) -> dict:
    return {"offload_optimizer": {"device": "nvme", "nvme_path": path, "pipeline_read": True, "pipeline_write": True,
                                  "buffer_count": 12, "fast_init": True, **optimizer},
            "offload_param": {"device": "nvme", "nvme_path": path, "max_in_cpu": 0, "buffer_count": 3,
                              "buffer_size": 100, **(param or {})}}


def _engine(seed: int, zero: dict, aio: dict | None = None, model: torch.nn.Module | None = None):
    import deepspeed

    torch.manual_seed(seed)
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(),
              "gradient_clipping": 0.5, "steps_per_print": 10**6, "zero_optimization": zero,
              "zero_force_ds_cpu_optimizer": False, "aio": aio or {"block_size": 4096, "queue_depth": 4}}
    model = model or TiedNet()
    # the same torch optimizer in memory and on NVMe: the comparison is of where the states live, nothing else
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02, weight_decay=0.01)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def _files(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _train_all(path: str, save_dir: str) -> dict:
    out = {}
    mem = _engine(0, ZERO)
    out["memory"] = [_step(mem, s) for s in range(6)]
    mem.destroy()
    nvme = _engine(0, {**ZERO, **_nvme(path)})
    out["swapped"] = (len(nvme.optimizer.swapped), len(nvme.optimizer.groups))
    out["nvme"] = [_step(nvme, s) for s in range(3)]
    out["files"] = _files(path)
    nvme.save_checkpoint(save_dir, tag="t3")
    out["nvme"] += [_step(nvme, s) for s in range(3, 6)]
    nvme.destroy()
    dist.barrier()  # every rank has destroyed its engine
    out["after_destroy"] = _files(path)
    resumed = _engine(7, {**ZERO, **_nvme(path)})
    resumed.load_checkpoint(save_dir)
    out["resumed"] = [_step(resumed, s) for s in range(3, 6)]
    resumed.destroy()
    plain = _engine(7, ZERO)
    plain.load_checkpoint(save_dir)
    out["in_memory_from_nvme"] = [_step(plain, s) for s in range(3, 6)]
    plain.destroy()
    half = _engine(0, {**ZERO, **_nvme(path, {"max_in_cpu": 50}, ratio=0.5, pipeline_read=False,
                                       pipeline_write=False, buffer_count=4, fast_init=False)})
    out["ratio_swapped"] = (len(half.optimizer.swapped), len(half.optimizer.groups))
    parts = [p.ds_tensor for p in dict.fromkeys(half.module.parameters())]
    out["in_cpu"] = [t.numel() for t in parts if t.device.type == "cpu"]
    out["on_nvme"] = sum(t.device.type == "meta" for t in parts)
    out["ratio"] = [_step(half, s) for s in range(6)]
    half.destroy()
    out["init"] = _zero_init_run(path)
    return out


def _zero_init_run(path: str) -> list[float]:
    """A model built under ``zero.Init(remote_device="nvme")``: its partitions go to NVMe as they are made."""
    import deepspeed

    config = {"zero_optimization": {**ZERO, **_nvme(path)}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=config):
        model = TiedNet()
    assert all(p.ds_tensor.device.type == "meta" for p in model.parameters())  # nothing left in memory
    engine = _engine(0, {**ZERO, **_nvme(path)}, model=model)
    losses = [_step(engine, s) for s in range(3)]
    engine.destroy()
    return losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    path, save_dir = tmp_path_factory.mktemp("nvme"), tmp_path_factory.mktemp("ckpt")
    return run_distributed(_train_all, world_size=2, args=(str(path), str(save_dir)), timeout=120)


def test_nvme_trains_like_stage3_in_memory(trained):
    for r in trained:
        assert r["swapped"][0] == r["swapped"][1] > 1  # every sub-group's master and states on NVMe
        assert r["nvme"] == pytest.approx(r["memory"], rel=1e-6)
        assert r["nvme"] != r["memory"][:1] * 6  # it trains
        assert r["init"] == pytest.approx(r["memory"][:3], rel=1e-6)


def test_swap_files_per_rank_and_removed_on_destroy(trained):
    files = trained[0]["files"]
    for rank in (0, 1):
        mine = [f for f in files if f"rank{rank}" in f.split(os.sep)]
        assert any("optimizer" in f and f.endswith("_exp_avg_sq.tensor.swp") for f in mine), files
        assert any("params" in f and f.endswith("_param.tensor.swp") for f in mine), files
    assert trained[0]["after_destroy"] == []


def test_resume_is_exact_and_checkpoint_loads_in_memory(trained):
    for r in trained:
        assert r["resumed"] == r["nvme"][3:]  # bit for bit
        assert r["in_memory_from_nvme"] == pytest.approx(r["nvme"][3:], rel=1e-6)


def test_partial_offload_ratio_and_max_in_cpu(trained):
    for r in trained:
        swapped, total = r["ratio_swapped"]
        assert total >= 2 and swapped == (total + 1) // 2
        assert r["ratio"] == pytest.approx(r["memory"], rel=1e-6)
        assert r["in_cpu"] and r["on_nvme"] and sum(r["in_cpu"]) <= 50  # max_in_cpu: elements kept in memory


def _truncate_first(folder: str, suffix: str) -> str:
    name = sorted(f for f in os.listdir(folder) if f.endswith(suffix))[0]
    path = os.path.join(folder, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return path


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is the point
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _failures(path: str) -> dict:
    out = {"missing": _error(lambda: _engine(0, {**ZERO, **_nvme(os.path.join(path, "nope"))})),
           "unwritable": _error(lambda: _engine(0, {**ZERO, **_nvme("/proc/self")})),
           "gds": _error(lambda: _engine(0, {**ZERO, **_nvme(path)}, aio={"use_gds": True}))}
    engine = _engine(0, {**ZERO, **_nvme(path)})
    _step(engine, 0)
    out["optimizer_file"] = _truncate_first(engine.optimizer.swapper.folder, "_master.tensor.swp")
    out["optimizer_read"] = _error(lambda: _step(engine, 1))
    engine.destroy()
    engine = _engine(0, {**ZERO, **_nvme(path)})
    swapper = next(p.ds_swapper for p in engine.module.parameters() if getattr(p, "ds_swapper", None))
    out["param_file"] = _truncate_first(swapper.folder, "_param.tensor.swp")
    out["param_read"] = _error(lambda: _step(engine, 0))
    engine.destroy()
    out["full"] = _full_disk(path)
    engine = _engine(0, {**ZERO, **_nvme(path, buffer_count=2)})
    out["few_buffers"] = _error(lambda: [_step(engine, s) for s in range(2)])  # Adam's states exist from step 1
    engine.destroy()
    return out


def _full_disk(path: str) -> str:
    """A disk that fills up: a file size limit makes the reservation of the next swap file fail (EFBIG)."""
    import resource
    import signal

    engine = _engine(0, {**ZERO, **_nvme(path)})
    _step(engine, 0)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, old[1]))
    try:
        return _error(lambda: _step(engine, 1)) + f" | folder={os.path.join(path, 'zero_stage_3')}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, previous)
        engine.destroy()


def test_failures_name_the_path_and_the_operation(tmp_path):
    for r in run_distributed(_failures, world_size=2, args=(str(tmp_path),), timeout=120):
        assert "nope" in r["missing"] and "does not exist" in r["missing"] and "AioError" in r["missing"]
        assert "/proc/self" in r["unwritable"] and "swap folder" in r["unwritable"]
        assert "aio.use_gds" in r["gds"] and "ConfigError" in r["gds"]
        for kind in ("optimizer", "param"):
            message = r[f"{kind}_read"]
            assert r[f"{kind}_file"] in message and "past end of file" in message, message
            assert "swap in" in message, message
        message, folder = r["full"].split(" | folder=")
        assert "AioError" in message and folder in message and "swap out" in message, message
        assert "File too large" in message, message  # EFBIG: the write past the limit, never a partial tensor
        assert "offload_optimizer.buffer_count=2" in r["few_buffers"] and "at least 4" in r["few_buffers"]

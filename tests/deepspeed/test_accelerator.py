"""``deepspeed.accelerator``: selection (``DS_ACCELERATOR``, auto-detect, ``set_accelerator``) and the CPU and
CUDA accelerators' answers, checked against torch itself."""

from __future__ import annotations

import pytest
import torch

from deepspeed.accelerator import (
    CPU_Accelerator,
    CUDA_Accelerator,
    DeepSpeedAccelerator,
    get_accelerator,
    real_accelerator,
    set_accelerator,
)


@pytest.fixture
def fresh(monkeypatch):
    """Forget the process-wide accelerator so the next get_accelerator() selects again."""
    monkeypatch.setattr(real_accelerator, "_current", None)


def test_auto_detect_follows_torch(fresh, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    accel = get_accelerator()
    assert accel.name == accel._name == expected
    assert get_accelerator() is accel  # one per process


def test_env_selects_cpu(fresh, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "CPU")
    accel = get_accelerator()
    assert isinstance(accel, CPU_Accelerator) and isinstance(accel, DeepSpeedAccelerator)
    assert accel.communication_backend_name() == "gloo"


def test_env_rejects_unknown_name(fresh, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR='tpu'.*\['cpu', 'cuda', 'xpu', 'npu', 'mps', 'hpu'"):
        get_accelerator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_env_cuda_without_cuda_is_an_error(fresh, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match="no usable CUDA device"):
        get_accelerator()


def test_set_accelerator(fresh):
    mine = CPU_Accelerator()
    set_accelerator(mine)
    assert get_accelerator() is mine
    set_accelerator("cpu")
    assert get_accelerator() is not mine and get_accelerator().name == "cpu"
    with pytest.raises(TypeError, match="DeepSpeedAccelerator"):
        set_accelerator(42)


def test_cpu_identity_and_dtypes(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    accel = CPU_Accelerator()
    assert accel.is_available() and accel.device_count() == 4  # DeepSpeed: int(LOCAL_SIZE) when > 0
    assert accel.current_device() == 3  # the rank's index on the host
    assert accel.device_name() == accel.device_name(1) == accel.current_device_name() == "cpu"
    assert accel.device() == torch.device("cpu")
    # DeepSpeed's CPU_Accelerator: bf16 always, fp16 only where oneDNN has fp16 kernels, order fp32, bf16, fp16.
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert accel.is_bf16_supported() is True and accel.is_fp16_supported() is fp16
    assert accel.supported_dtypes() == [torch.float32, torch.bfloat16] + ([torch.float16] if fp16 else [])
    assert accel.is_synchronized_device() and accel.use_host_timers()
    t = torch.ones(3)
    assert accel.on_accelerator(t) and accel.pin_memory(t).device.type == "cpu"
    with pytest.raises(ValueError, match="device_index"):
        accel.set_device(-1)


def test_cpu_device_count_follows_local_size_then_numa(monkeypatch):
    from deepspeed.accelerator import cpu_accelerator

    accel = CPU_Accelerator()
    monkeypatch.setenv("LOCAL_SIZE", "2")  # a 2-process job on one CPU host sees 2 devices
    assert accel.device_count() == 2
    # LOCAL_SIZE unset or <= 0: NUMA nodes with cores; fake-NUMA duplicates once, core-less HBM nodes skipped.
    for local_size in (None, "0", "-1"):
        if local_size is None:
            monkeypatch.delenv("LOCAL_SIZE")
        else:
            monkeypatch.setenv("LOCAL_SIZE", local_size)
        monkeypatch.setattr(cpu_accelerator, "numa_core_lists", lambda: [[0, 1], [0, 1], [2, 3], [], []])
        assert accel.device_count() == 2
        monkeypatch.setattr(cpu_accelerator, "numa_core_lists", lambda: [])  # numactl/sysfs unavailable
        assert accel.device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "two")  # DeepSpeed's int() raises ValueError; ours names the variable
    with pytest.raises(ValueError, match="LOCAL_SIZE='two'"):
        accel.device_count()


def test_numa_core_lists_reads_sysfs(tmp_path):
    from deepspeed.launcher.resources import numa_core_lists

    for node, cpus in ((1, "4-5,7\n"), (0, "0-3\n"), (2, "\n")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus)
    assert numa_core_lists(str(tmp_path)) == [[0, 1, 2, 3], [4, 5, 7], []]
    assert numa_core_lists(str(tmp_path / "missing")) == []


def test_cpu_fp16_follows_onednn(monkeypatch):
    accel = CPU_Accelerator()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    assert accel.is_fp16_supported() is False
    assert accel.supported_dtypes() == [torch.float32, torch.bfloat16]
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: True)
    assert accel.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]


def test_cpu_rng_streams_events():
    accel = CPU_Accelerator()
    accel.manual_seed(123)
    a = torch.rand(4)
    accel.manual_seed_all(123)
    assert torch.equal(a, torch.rand(4))
    assert accel.initial_seed() == 123
    state = accel.get_rng_state()
    b = torch.rand(2)
    accel.set_rng_state(state)
    assert torch.equal(b, torch.rand(2))
    assert accel.Stream is torch.cpu.Stream and accel.Event is torch.cpu.Event
    with accel.stream(accel.current_stream()):
        accel.synchronize()
    accel.range_push("outer")
    accel.range_pop()
    with pytest.raises(RuntimeError, match="no open range"):
        accel.range_pop()


def test_cpu_memory_is_process_rss():
    accel = CPU_Accelerator()
    accel.empty_cache()
    accel.reset_peak_memory_stats()
    before = accel.memory_allocated()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched so it is resident
    grown = accel.memory_allocated() - before
    assert grown > 48 * 2**20
    assert accel.max_memory_allocated() >= accel.memory_allocated()
    del block
    assert accel.max_memory_allocated() - accel.memory_allocated() > 32 * 2**20  # the peak remembers it
    accel.reset_peak_memory_stats()
    assert accel.max_memory_allocated() - accel.memory_allocated() < 16 * 2**20
    assert accel.total_memory() >= accel.available_memory() > 0
    stats = accel.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0


def test_cuda_accelerator_names_without_a_device():
    accel = CUDA_Accelerator()
    assert accel.communication_backend_name() == "nccl"
    assert accel.device_name() == "cuda" and accel.device_name(2) == "cuda:2"
    assert accel.is_available() == torch.cuda.is_available()
    assert accel.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    env: dict[str, str] = {}
    accel.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}


@pytest.mark.gpu
def test_cuda_accelerator_on_a_device():
    accel = CUDA_Accelerator()
    accel.set_device(0)
    assert accel.current_device_name() == "cuda:0" and accel.device_count() == torch.cuda.device_count()
    accel.reset_peak_memory_stats()
    x = torch.empty(2**20, device=accel.current_device_name())
    assert accel.memory_allocated() >= x.numel() * 4 and accel.max_memory_allocated() >= accel.memory_allocated()
    assert torch.float16 in accel.supported_dtypes() and accel.on_accelerator(x)
    assert accel.pin_memory(torch.ones(2)).is_pinned()
    event = accel.Event(enable_timing=True)
    event.record()
    accel.synchronize()
    assert accel.total_memory() >= accel.available_memory() > 0

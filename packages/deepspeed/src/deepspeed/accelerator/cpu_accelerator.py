"""``CPU_Accelerator``: ranks are host processes talking over gloo.

Memory figures on CPU are the process's resident set size (RSS, bytes) from ``/proc/self/status``, not bytes of
tensors: the host has no separate allocator to ask. The peak is the kernel's high-water mark (VmHWM), reset
through ``/proc/self/clear_refs``; where that is unavailable the peak is ``ru_maxrss`` and cannot be reset.
"""

from __future__ import annotations

import os
import resource

import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator, local_rank_from_env
from deepspeed.launcher.resources import local_size, numa_accelerator_count, numa_core_lists

_PROC_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), or None off Linux."""
    try:
        with open(_PROC_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _meminfo_kib(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    """The host as DeepSpeed's device: ``LOCAL_SIZE`` logical devices (one per rank of the host), the
    rank's index ``LOCAL_RANK``."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._ranges: list[torch.profiler.record_function] = []

    def is_synchronized_device(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        """As DeepSpeed's: ``LOCAL_SIZE`` (the ranks on this host) when set and > 0, else the NUMA nodes that
        own cores (duplicate fake-NUMA nodes once, core-less HBM nodes not), at least 1."""
        return local_size(os.environ) or numa_accelerator_count(numa_core_lists())

    def current_device(self) -> int:
        """The rank's ``LOCAL_RANK`` (0 outside a launcher): its index among the ranks of this host."""
        return local_rank_from_env()

    def device_name(self, device_index: int | None = None) -> str:
        """Always ``"cpu"``: torch has one CPU device, whatever the rank's index."""
        return self._name

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def current_device_name(self) -> str:
        return self._name

    def set_device(self, device_index: int) -> None:
        """Nothing to select on the host; kept so device-neutral code can call it."""
        if int(device_index) < 0:
            raise ValueError(f"set_device: device_index must be >= 0, got {device_index}")

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU kernels are synchronous; this only orders the CPU stream (a no-op in practice)."""
        torch.cpu.synchronize()

    # -- memory: process RSS in bytes ---------------------------------------------------------------------
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Current resident set size of this process, bytes."""
        rss = _status_kib("VmRSS")
        if rss is None:
            return self.max_memory_allocated(device_index)
        return rss * 1024

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak resident set size since start or the last ``reset_peak_memory_stats``, bytes."""
        hwm = _status_kib("VmHWM")
        if hwm is None:  # ru_maxrss is KiB on Linux, bytes on macOS
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if os.uname().sysname == "Darwin" else peak * 1024
        return hwm * 1024

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Reset the RSS high-water mark to the current RSS (Linux ``clear_refs`` 5); no-op elsewhere."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def range_push(self, msg: str) -> None:
        """Open a ``torch.profiler`` record named ``msg`` (visible in profiler traces)."""
        record = torch.profiler.record_function(msg)
        record.__enter__()
        self._ranges.append(record)

    def range_pop(self) -> None:
        if not self._ranges:
            raise RuntimeError("range_pop: no open range (range_push was not called)")
        self._ranges.pop().__exit__(None, None, None)

    def empty_cache(self) -> None:
        """The host allocator keeps no cache DeepSpeed could release: nothing to do."""

    def total_memory(self, device_index: int | None = None) -> int:
        """Physical memory of the host, bytes."""
        total = _meminfo_kib("MemTotal")
        if total is None:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total * 1024

    def available_memory(self, device_index: int | None = None) -> int:
        """Memory the host can still hand out without swapping (``MemAvailable``), bytes."""
        available = _meminfo_kib("MemAvailable")
        return self.total_memory() - self.memory_allocated() if available is None else available * 1024

    # -- pinning ------------------------------------------------------------------------------------------
    # torch cannot page-lock host memory without a device: torch-backend "pinning" hands the tensor back as
    # it is (and counts nothing). DS_PIN_MEMORY_BACKEND=native really locks it (mlock, deepspeed.utils.pin_memory).
    _torch_pins_host_memory = False

    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _torch_empty_pinned(self, template: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return template.new_empty(shape)

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        # a CUDA build of torch on a GPU-less host would try to reach the driver to answer
        return torch.cuda.is_available() and tensor.is_pinned()

    # -- dtypes -------------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        """True, as DeepSpeed's CPU accelerator: torch computes bf16 on every CPU (natively or converted)."""
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has fp16 kernels for this CPU (AVX512-FP16/AMX-FP16), DeepSpeed's test."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):  # a torch built without mkldnn
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        """DeepSpeed's CPU order: fp32, bf16, then fp16 where this CPU has fp16 kernels."""
        dtypes = [torch.float32, torch.bfloat16]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

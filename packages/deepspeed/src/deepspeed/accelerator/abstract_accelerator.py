"""``DeepSpeedAccelerator``: the device-neutral interface DeepSpeed code and its clients program against.

Device-specific parts are abstract; everything that torch already expresses per device type (RNG, dtypes,
pinning, tensor placement) is implemented once here on top of ``torch.device`` and ``torch.get_device_module``.
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from deepspeed.utils.pin_memory import get_active_native_pinned_memory
from deepspeed.utils.pin_memory_tracker import track_pinned_memory


class DeepSpeedAccelerator(abc.ABC):
    """One device family (``cpu`` or ``cuda``). ``_name`` is the torch device type; ``_communication_backend_name``
    the ``torch.distributed`` backend its ranks use."""

    _name: str = ""
    _communication_backend_name: str = ""
    _compile_backend: str = "inductor"

    # -- identity -----------------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` or ``"cuda:3"``: the torch device string for ``device_index`` (the type when None)."""
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        """The ``torch.device`` for ``device_index`` (the current device when None)."""
        return torch.device(self._name, self.current_device() if device_index is None else device_index)

    def current_device_name(self) -> str:
        """The current device as a string, e.g. ``"cuda:0"``."""
        return self.device_name(self.current_device())

    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend for this device family (``gloo`` on CPU, ``nccl`` on CUDA)."""
        return self._communication_backend_name

    @property
    def name(self) -> str:
        return self._name

    def is_synchronized_device(self) -> bool:
        """True when kernels finish before the call returns (CPU): no stream synchronisation is needed."""
        return False

    def use_host_timers(self) -> bool:
        """Whether wall-clock timers on the host measure device work (true for synchronized devices)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # -- device management (device specific) --------------------------------------------------------------
    @abc.abstractmethod
    def is_available(self) -> bool: ...

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def current_device(self) -> int: ...

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None: ...

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None: ...

    # -- RNG ----------------------------------------------------------------------------------------------
    def random(self):
        """The ``torch.random`` module (seeding helpers shared by every device)."""
        return torch.random

    def manual_seed(self, seed: int) -> None:
        """Seed the generator of the current device (and the CPU one, which torch seeds alongside)."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of every device of this family."""
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    @property
    def default_generator(self) -> Callable[[int], torch.Generator]:
        """``default_generator(index)``: the default generator of device ``index``."""
        return lambda index: torch.default_generator

    # -- memory (device specific) -------------------------------------------------------------------------
    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def empty_cache(self) -> None: ...

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int: ...

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self.memory_allocated(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self.max_memory_allocated(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        """The DeepSpeed-used subset of torch's memory statistics, in bytes."""
        return {
            "allocated_bytes.all.current": self.memory_allocated(device_index),
            "allocated_bytes.all.peak": self.max_memory_allocated(device_index),
            "reserved_bytes.all.current": self.memory_reserved(device_index),
            "reserved_bytes.all.peak": self.max_memory_reserved(device_index),
        }

    # -- dtypes -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool: ...

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool: ...

    def supported_dtypes(self) -> list[torch.dtype]:
        """Floating dtypes the device computes in: fp32 always, then fp16 / bf16 where supported."""
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_triton_supported(self) -> bool:
        return False

    def amp(self):
        """The ``torch.<device>.amp`` module."""
        return torch.get_device_module(self._name).amp

    # -- streams and events -------------------------------------------------------------------------------
    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name: a class-valued attribute
        return torch.get_device_module(self._name).Stream

    @property
    def Event(self):  # noqa: N802
        return torch.get_device_module(self._name).Event

    def stream(self, stream):
        """Context manager making ``stream`` current."""
        return torch.get_device_module(self._name).stream(stream)

    def current_stream(self, device_index: int | None = None):
        return torch.get_device_module(self._name).current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return self.current_stream(device_index)

    # -- tensors ------------------------------------------------------------------------------------------
    # Pinning dispatches between the native backend (``deepspeed.utils.pin_memory``, chosen per call by
    # DS_PIN_MEMORY_BACKEND=native) and torch's pinning (the ``_torch_*`` primitives a device overrides).
    # Every byte really page-locked is counted by ``deepspeed.utils.pin_memory_tracker``.
    _torch_pins_host_memory = True  # False where torch cannot pin (the CPU accelerator): its "pinning" is a no-op

    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def _torch_empty_pinned(self, template: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return template.new_empty(shape, pin_memory=True)

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Register page-locked host memory with this device's runtime; whether it did (False: nothing to do)."""
        return False

    def unregister_host_memory(self, address: int) -> None:
        """Undo :meth:`register_host_memory` for the range starting at ``address`` (nothing was registered here)."""
        return None

    def pin_memory_alignment(self) -> int:
        """Address alignment (bytes) the runtime needs of registered host memory; 1 for none."""
        return 1

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True, *,
                   align_bytes: int = 1) -> torch.Tensor:
        """A page-locked host tensor with ``tensor``'s values (``make_copy=False``: a fresh uninitialised one)
        and shape (``match_shape=False``: flat), for fast asynchronous device copies. ``align_bytes`` (older
        DeepSpeed's argument) is accepted and unused: pinned buffers start on a page boundary anyway."""
        pins = get_active_native_pinned_memory()
        if pins is not None:
            track_pinned_memory(tensor.nbytes)
            return pins.pin(tensor, make_copy=make_copy, match_shape=match_shape, registrar=self)
        if make_copy:
            pinned = self._torch_pin_memory(tensor)
            if self._torch_pins_host_memory:
                track_pinned_memory(pinned.nbytes)
            return pinned
        # ``tensor`` only gives shape and dtype: pin a fresh buffer rather than copying it into one
        return self._pin_fresh(tensor, tuple(tensor.shape) if match_shape else (tensor.numel(),))

    def pin_empty(self, *size: Any, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
        """An uninitialised page-locked host tensor of ``size`` (ints, or one sequence) and ``dtype``."""
        _require_host(device, "pin_empty")
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return self._pin_fresh(torch.empty(0, dtype=dtype), tuple(int(d) for d in shape))

    def pin_empty_like(self, tensor: torch.Tensor, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised page-locked host tensor shaped like ``tensor`` (its dtype unless ``dtype``)."""
        _require_host(device, "pin_empty_like")
        return self._pin_fresh(torch.empty(0, dtype=dtype or tensor.dtype), tuple(tensor.shape))

    def _pin_fresh(self, template: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        pins = get_active_native_pinned_memory()
        if pins is not None or self._torch_pins_host_memory:
            track_pinned_memory(math.prod(shape) * template.element_size())
        if pins is not None:
            return pins.pin_empty(template, shape, registrar=self)
        return self._torch_empty_pinned(template, shape)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is page-locked: natively pinned (views count) or pinned by torch."""
        pins = get_active_native_pinned_memory()
        if pins is not None and pins.is_pinned(tensor):
            return True
        return self._torch_is_pinned(tensor)

    def unpin_memory(self, tensor: torch.Tensor) -> bool | None:
        """Free a natively pinned buffer now (True when one was freed); None with torch pinning, whose
        buffers are freed with their last tensor."""
        pins = get_active_native_pinned_memory()
        return pins.unpin(tensor) if pins is not None else None

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device family."""
        return tensor.device.type == self._name

    def __getattr__(self, name: str) -> Any:
        """DeepSpeed's typed-tensor constructors (``ByteTensor``, ``FloatTensor``, ...) on this device."""
        from deepspeed.accelerator._tensor_types import TENSOR_TYPES, TypedTensor

        if name in TENSOR_TYPES:
            return TypedTensor(TENSOR_TYPES[name], self._name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- profiling ranges, lazy init, environment ---------------------------------------------------------
    @abc.abstractmethod
    def range_push(self, msg: str) -> None:
        """Open a named profiler range (NVTX on CUDA, a torch.profiler record on CPU)."""

    @abc.abstractmethod
    def range_pop(self) -> None:
        """Close the innermost profiler range."""

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` once the device is initialised (immediately on CPU)."""
        callback()

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that restrict which devices a process sees."""
        return []

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        """Prefixes of environment variables the launcher forwards to every node."""
        return []

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the ``torch.compile`` backend; it must be registered with torch._dynamo."""
        import torch._dynamo

        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(
                f"set_compile_backend: {backend!r} is not a torch.compile backend; choose from {supported}"
            )
        self._compile_backend = backend

    # ---- op builders: the ds-ops builders under DeepSpeed's accelerator API ----
    def op_builder_dir(self) -> str:
        return "deepspeed.ops.op_builder"

    def get_op_builder(self, class_name: str) -> type | None:
        """The op-builder class called ``class_name`` (``"CPUAdamBuilder"``, ``"FlashAttentionBuilder"``, ...), or
        None when there is no such builder. A builder of an op this version does not build reports itself
        incompatible and refuses ``load()`` with the reason, as DeepSpeed's do on an accelerator without the op."""
        from ds_ops import op_builder

        return getattr(op_builder, class_name, None) if class_name.endswith("Builder") else None

    def create_op_builder(self, class_name: str) -> Any:
        """An instance of :meth:`get_op_builder`'s class, or None."""
        builder = self.get_op_builder(class_name)
        return builder() if builder is not None else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, backend={self._communication_backend_name!r})"


def _require_host(device: str | torch.device, what: str) -> None:
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{what}: device={device!r} is not a device; pinned buffers live on the host ('cpu')") from exc
    if kind != "cpu":
        raise ValueError(f"{what}: device={device!r}; pinned buffers live on the host, device must be 'cpu'")


def local_rank_from_env(default: int = 0) -> int:
    """``LOCAL_RANK`` from the launcher environment (``default`` when unset)."""
    return int(os.environ.get("LOCAL_RANK", default))

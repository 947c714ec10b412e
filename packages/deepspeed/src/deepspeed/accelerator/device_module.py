"""``DeviceModuleAccelerator``: an accelerator served by a torch device module (``torch.xpu``, ``torch.mps``, or
the ``torch.<name>`` a vendor plugin registers: ``torch.npu`` from ``torch_npu``, ``torch.hpu`` from Habana's
``habana_frameworks.torch``, ``torch.mlu``, ``torch.sdaa``, ``torch.supa``).

Those modules follow ``torch.cuda``'s API (device count and selection, RNG, caching-allocator figures), so one
implementation over ``torch.get_device_module`` serves them all; each vendor's ``<name>_accelerator.py`` only says
its device type, collective backend, plugin and visible-devices variable, and overrides what differs. The
plugin is imported on first use, not at import, so every accelerator class is importable on any machine; a
missing plugin makes ``is_available()`` False and any device call a RuntimeError naming the package to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator


class DeviceModuleAccelerator(DeepSpeedAccelerator):
    """A device family whose torch module mirrors ``torch.cuda``. Subclasses set ``_name``,
    ``_communication_backend_name``, ``_plugin`` (the package that registers ``torch.<_name>``, None when torch
    has it built in) and ``_visible_devices_envs``."""

    _plugin: str | None = None
    _visible_devices_envs: tuple[str, ...] = ()

    def _device_module(self) -> ModuleType:
        if self._plugin is not None:
            try:
                importlib.import_module(self._plugin)
            except ImportError as exc:
                raise RuntimeError(f"the {self._name!r} accelerator needs the {self._plugin!r} package, which is not "
                                   f"importable here: {exc}") from exc
        try:
            return torch.get_device_module(self._name)
        except (RuntimeError, AttributeError) as exc:
            raise RuntimeError(f"torch {torch.__version__} has no {self._name!r} device module: {exc}") from exc

    def _call(self, fn: str, *args: Any, default: Any = None) -> Any:
        """``torch.<name>.<fn>(*args)``; ``default`` where the module lacks ``fn`` (not every backend has every
        allocator figure), an AttributeError when no default is given."""
        member = getattr(self._device_module(), fn, None)
        if member is None:
            if default is not None:
                return default
            raise AttributeError(f"torch.{self._name} has no {fn}(); the {self._name!r} accelerator cannot answer it")
        return member(*args)

    # -- devices ------------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        try:
            return bool(self._call("is_available"))
        except (RuntimeError, AttributeError):
            return False

    def device_count(self) -> int:
        return int(self._call("device_count"))

    def current_device(self) -> int:
        return int(self._call("current_device"))

    def set_device(self, device_index: int) -> None:
        self._call("set_device", device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        self._call("synchronize", device_index)

    # -- RNG ----------------------------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self._call("manual_seed", seed)

    def manual_seed_all(self, seed: int) -> None:
        self._call("manual_seed_all", seed)

    def initial_seed(self) -> int:
        return int(self._call("initial_seed"))

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return self._call("get_rng_state", self._name if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        self._call("set_rng_state", new_state, self._name if device_index is None else device_index)

    @property
    def default_generator(self) -> Callable[[int], torch.Generator]:
        return lambda index: self._device_module().default_generators[index]

    # -- memory: the device allocator's figures, bytes ----------------------------------------------------
    def memory_allocated(self, device_index: int | None = None) -> int:
        return int(self._call("memory_allocated", device_index))

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return int(self._call("max_memory_allocated", device_index))

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._call("reset_peak_memory_stats", device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return int(self._call("memory_reserved", device_index))

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return int(self._call("max_memory_reserved", device_index))

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return dict(self._call("memory_stats", device_index))

    def empty_cache(self) -> None:
        self._call("empty_cache")

    def total_memory(self, device_index: int | None = None) -> int:
        index = self.current_device() if device_index is None else device_index
        return int(self._call("get_device_properties", index).total_memory)

    def available_memory(self, device_index: int | None = None) -> int:
        module = self._device_module()
        if hasattr(module, "mem_get_info"):
            return int(module.mem_get_info(device_index)[0])
        return self.total_memory(device_index) - self.memory_reserved(device_index)

    # -- dtypes -------------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        if not self.is_available():
            return False
        return bool(self._call("is_bf16_supported", default=True))

    def is_fp16_supported(self) -> bool:
        return self.is_available()

    # -- profiling ranges, lazy init, environment ---------------------------------------------------------
    def range_push(self, msg: str) -> None:
        """Open a ``torch.profiler`` record named ``msg`` (these devices have no NVTX)."""
        record = torch.profiler.record_function(msg)
        record.__enter__()
        self.__dict__.setdefault("_open_ranges", []).append(record)

    def range_pop(self) -> None:
        ranges = self.__dict__.get("_open_ranges")
        if not ranges:
            raise RuntimeError("range_pop: no open range (range_push was not called)")
        ranges.pop().__exit__(None, None, None)

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        lazy = getattr(self._device_module(), "_lazy_call", None)
        if lazy is None:
            callback()
        else:
            lazy(callback)

    def visible_devices_envs(self) -> list[str]:
        return list(self._visible_devices_envs)

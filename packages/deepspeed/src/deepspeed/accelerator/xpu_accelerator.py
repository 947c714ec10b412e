"""``XPU_Accelerator``: Intel GPUs through torch's built-in ``torch.xpu``, ranks over ``xccl`` (torch's own) or
``ccl`` where Intel's ``oneccl_bindings_for_pytorch`` is installed, as DeepSpeed chooses."""

from __future__ import annotations

import importlib.util

from deepspeed.accelerator.device_module import DeviceModuleAccelerator


class XPU_Accelerator(DeviceModuleAccelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "xpu"
    _communication_backend_name = "xccl"
    _visible_devices_envs = ("ZE_AFFINITY_MASK",)

    def communication_backend_name(self) -> str:
        if importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None:
            return "ccl"
        return self._communication_backend_name

"""``SDAA_Accelerator``: Tecorigin SDAA devices through ``torch.sdaa`` (registered by the ``torch_sdaa`` package),
ranks over ``tccl``. Everything else is :class:`~deepspeed.accelerator.device_module.DeviceModuleAccelerator`'s."""

from __future__ import annotations

from deepspeed.accelerator.device_module import DeviceModuleAccelerator


class SDAA_Accelerator(DeviceModuleAccelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "sdaa"
    _communication_backend_name = "tccl"
    _plugin = "torch_sdaa"
    _visible_devices_envs = ('SDAA_VISIBLE_DEVICES',)

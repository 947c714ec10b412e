"""``SUPA_Accelerator``: Biren SUPA GPUs through ``torch.supa`` (registered by the ``torch_supa`` package),
ranks over ``bccl``. Everything else is :class:`~deepspeed.accelerator.device_module.DeviceModuleAccelerator`'s."""

from __future__ import annotations

from deepspeed.accelerator.device_module import DeviceModuleAccelerator


class SUPA_Accelerator(DeviceModuleAccelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "supa"
    _communication_backend_name = "bccl"
    _plugin = "torch_supa"
    _visible_devices_envs = ('SUPA_VISIBLE_DEVICES',)

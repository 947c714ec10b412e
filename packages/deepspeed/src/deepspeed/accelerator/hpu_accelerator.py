"""``HPU_Accelerator``: Intel Gaudi (Habana) HPUs through ``torch.hpu`` (registered by ``habana_frameworks.torch``),
ranks over ``hccl``. Everything else is :class:`~deepspeed.accelerator.device_module.DeviceModuleAccelerator`'s."""

from __future__ import annotations

from deepspeed.accelerator.device_module import DeviceModuleAccelerator


class HPU_Accelerator(DeviceModuleAccelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "hpu"
    _communication_backend_name = "hccl"
    _plugin = "habana_frameworks.torch"
    _visible_devices_envs = ('HABANA_VISIBLE_MODULES',)
    _compile_backend = "hpu_backend"

"""``MLU_Accelerator``: Cambricon MLUs through ``torch.mlu`` (registered by the ``torch_mlu`` package),
ranks over ``cncl``. Everything else is :class:`~deepspeed.accelerator.device_module.DeviceModuleAccelerator`'s."""

from __future__ import annotations

from deepspeed.accelerator.device_module import DeviceModuleAccelerator


class MLU_Accelerator(DeviceModuleAccelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "mlu"
    _communication_backend_name = "cncl"
    _plugin = "torch_mlu"
    _visible_devices_envs = ('MLU_VISIBLE_DEVICES',)

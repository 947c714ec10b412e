"""``NPU_Accelerator``: Huawei Ascend NPUs through ``torch.npu`` (registered by the ``torch_npu`` package),
ranks over ``hccl``. Everything else is :class:`~deepspeed.accelerator.device_module.DeviceModuleAccelerator`'s."""

from __future__ import annotations

from deepspeed.accelerator.device_module import DeviceModuleAccelerator


class NPU_Accelerator(DeviceModuleAccelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "npu"
    _communication_backend_name = "hccl"
    _plugin = "torch_npu"
    _visible_devices_envs = ('ASCEND_RT_VISIBLE_DEVICES',)

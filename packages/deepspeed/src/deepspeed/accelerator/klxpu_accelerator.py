"""``KLXPU_Accelerator``: Kunlunxin XPUs, which the ``torch_xmlir`` plugin presents through ``torch.cuda``: device
strings, streams, RNG and memory are CUDA's; only the name and the timing differ (its device events read 0
unless ``XPU_EVENT_KL3_ENABLE=1``, so timers run on the host), and it has no Triton."""

from __future__ import annotations

import os

from deepspeed.accelerator import cuda_accelerator


class KLXPU_Accelerator(cuda_accelerator.CUDA_Accelerator):  # noqa: N801 - DeepSpeed's class name
    _name = "cuda"  # torch's device type: tensors live on "cuda" devices

    @property
    def name(self) -> str:
        return "klxpu"

    def use_host_timers(self) -> bool:
        return os.environ.get("XPU_EVENT_KL3_ENABLE", "0") != "1"

    def is_triton_supported(self) -> bool:
        return False

"""The native ops of ds-ops, one builder each (DeepSpeed's names)."""

from __future__ import annotations

from ds_ops.op_builder._builder import OpBuilder


class CPUAdamBuilder(OpBuilder):
    """Adam/AdamW for CPU tensors: fp32, bf16 and fp16 params, fused low-precision copy."""

    NAME = "cpu_adam"
    SOURCES = ("cpu_adam.cpp",)
    SYMBOLS = ("ds_cpu_adam_step",)


class CPUAdagradBuilder(OpBuilder):
    """Adagrad for CPU tensors."""

    NAME = "cpu_adagrad"
    SOURCES = ("cpu_adagrad.cpp",)
    SYMBOLS = ("ds_cpu_adagrad_step",)


class CPULionBuilder(OpBuilder):
    """Lion for CPU tensors."""

    NAME = "cpu_lion"
    SOURCES = ("cpu_lion.cpp",)
    SYMBOLS = ("ds_cpu_lion_step",)


class BandwidthProbeBuilder(OpBuilder):
    """Memory-bandwidth reference kernels used by benchmarks/cpu_adam.py (not an optimizer)."""

    NAME = "bandwidth_probe"
    SOURCES = ("bandwidth_probe.cpp",)
    SYMBOLS = ("ds_probe_scale_add", "ds_probe_plain_adamw")

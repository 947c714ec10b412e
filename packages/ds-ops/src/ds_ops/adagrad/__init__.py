"""Adagrad optimizers (``deepspeed.ops.adagrad``)."""

from ds_ops.adagrad.cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]

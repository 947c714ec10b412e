"""The inference kernels' elementwise ops (DeepSpeed's ``op_binding``), computed in torch. DeepSpeed's GEMM,
softmax and attention bindings (``LinearOp``, ``QKVGemmOp``, ``SoftmaxContextOp``, ...) serve kernel injection,
which this version does not build."""

from .base import BaseOp
from .bias_add import BiasAddOp
from .bias_gelu import BiasGeluOp
from .bias_relu import BiasReluOp
from .residual_add import ResidualAddOp
from .vector_add import VectorAddOp

__all__ = ["BaseOp", "BiasAddOp", "BiasGeluOp", "BiasReluOp", "ResidualAddOp", "VectorAddOp"]

"""The inference kernels' elementwise and normalisation ops (DeepSpeed's ``op_binding``), computed in torch.
DeepSpeed's GEMM, softmax and attention bindings (``LinearOp``, ``QKVGemmOp``, ``SoftmaxContextOp``, ...) serve
kernel injection, which this version does not build."""

from .base import BaseOp
from .bias_add import BiasAddOp
from .bias_gelu import BiasGeluOp
from .bias_relu import BiasReluOp
from .gated_activation import GatedActivationOp
from .layer_norm import LayerNormOp
from .moe_res_matmul import MoEResMatmulOp
from .pre_rms_norm import PreRMSNormOp
from .residual_add import ResidualAddOp
from .rms_norm import RMSNormOp
from .vector_add import VectorAddOp

__all__ = ["BaseOp", "BiasAddOp", "BiasGeluOp", "BiasReluOp", "GatedActivationOp", "LayerNormOp", "MoEResMatmulOp",
           "PreRMSNormOp", "RMSNormOp", "ResidualAddOp", "VectorAddOp"]

"""``deepspeed.linear``: LoRA layers over a frozen base weight that can be sharded across ranks and stored in FP8
(``OptimizedLinear``, ``LoRAConfig``, ``QuantizationConfig``), and ``Init``/``init_lora`` to build a model with
them. See docs/linear.md."""

from deepspeed.linear.config import LoRAConfig, QuantizationConfig
from deepspeed.linear.context_manager import Init, init_lora
from deepspeed.linear.optimized_linear import LoRAOptimizedLinear, OptimizedLinear
from deepspeed.linear.quantization import QuantizedLinear, QuantizedParameter

__all__ = ["Init", "LoRAConfig", "LoRAOptimizedLinear", "OptimizedLinear", "QuantizationConfig", "QuantizedLinear",
           "QuantizedParameter", "init_lora"]

"""Linear and Embedding layers whose weight is stored group-wise quantized (``utils``) and dequantized for each
forward. A weight shared by several layers (tied embeddings) is quantized once: the registry maps the original
parameter to its packed form while a model is being converted."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ds_inference.group_quant.utils import DeQuantizer, Quantizer, concat_to_compat_param, dequantized_weight

quantized_weight_registry: dict[int, nn.Parameter] = {}


def get_quantize_weight_fn(quantizer: Quantizer, pre_quant_weight: nn.Parameter) -> Callable:
    def quantize() -> tuple[Tensor, Tensor, Tensor]:
        return quantizer.quantize(pre_quant_weight.data)

    return quantize


def get_quantized_weight_wrapper(model: nn.Module, pre_quant_weight: nn.Parameter,
                                 quantize_weight_fn: Callable) -> nn.Parameter:
    """The packed parameter for ``pre_quant_weight``, quantized on first request and shared afterwards."""
    key = id(pre_quant_weight)
    if key not in quantized_weight_registry:
        quantized_weight_registry[key] = concat_to_compat_param(*quantize_weight_fn())
    return quantized_weight_registry[key]


def _quantized_weight(layer: nn.Module, config: dict, weight: nn.Parameter) -> nn.Parameter:
    packed = get_quantized_weight_wrapper(layer, weight, get_quantize_weight_fn(Quantizer(config), weight))
    packed.dequantizer = DeQuantizer(config, weight.dtype)
    return packed


class QuantizedLinear(nn.Linear):
    """``QuantizedLinear(config, pre_quant_layer)``: ``pre_quant_layer``'s weight quantized, its bias kept."""

    def __init__(self, config: dict, pre_quant_layer: nn.Linear) -> None:
        weight = pre_quant_layer.weight
        super().__init__(pre_quant_layer.in_features, pre_quant_layer.out_features, bias=False, device="meta",
                         dtype=weight.dtype)
        self.config = config
        self.quantizer = Quantizer(config)
        self.bias = pre_quant_layer.bias
        self.weight = _quantized_weight(self, config, weight)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn.Linear's name
        # torch's own linear: a ZeRO-3 replacement of F.linear would treat the temporary weight as a parameter
        return torch._C._nn.linear(input, dequantized_weight(self.weight), self.bias)


class QuantizedEmbedding(nn.Embedding):
    """``QuantizedEmbedding(config, pre_quant_layer)``: an embedding table stored quantized (plain lookups only:
    no ``max_norm``, ``scale_grad_by_freq`` or sparse gradients)."""

    def __init__(self, config: dict, pre_quant_layer: nn.Embedding) -> None:
        layer = pre_quant_layer
        unsupported = {k: v for k, v in (("max_norm", layer.max_norm), ("scale_grad_by_freq", layer.scale_grad_by_freq),
                                         ("sparse", layer.sparse)) if v}
        if unsupported or layer.norm_type != 2:
            raise ValueError(f"QuantizedEmbedding does not support {unsupported or {'norm_type': layer.norm_type}}")
        super().__init__(layer.num_embeddings, layer.embedding_dim, padding_idx=layer.padding_idx, device="meta",
                         dtype=layer.weight.dtype)
        self.config = config
        self.weight = _quantized_weight(self, config, layer.weight)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn.Embedding's name
        return F.embedding(input, dequantized_weight(self.weight), self.padding_idx)


QUANTIZATION_LAYER_MAPPINGS = {nn.Linear: QuantizedLinear, nn.Embedding: QuantizedEmbedding}

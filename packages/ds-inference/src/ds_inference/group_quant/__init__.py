"""Group-wise INT4/INT8 weight-only quantization (``deepspeed.inference.quantization``): ``utils.Quantizer`` /
``utils.DeQuantizer`` (asymmetric, one scale and minimum per group of ``group_size`` values along ``group_dim``),
``layers.QuantizedLinear`` / ``layers.QuantizedEmbedding`` (weights stored quantized, dequantized per forward),
and ``quantization._init_group_wise_weight_quantization`` (swap a model's matching layers for them)."""

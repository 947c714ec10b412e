"""The op table: which aten op costs what. Ops not listed (views, copies, indexing, comparisons, random
number generation, integer arithmetic) cost nothing. Names missing from the installed torch are skipped.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_profiler import _rules_dense as dense
from ds_profiler import _rules_pointwise as pw

_ARITHMETIC = (
    "add sub rsub mul div neg reciprocal pow sqrt rsqrt exp exp2 expm1 log log2 log10 log1p abs sin cos tan "
    "asin acos atan atan2 sinh cosh asinh acosh atanh erf erfc erfinv maximum minimum fmax fmin clamp clamp_min "
    "clamp_max square remainder fmod floor ceil round trunc frac sign sgn xlogy hypot logaddexp sigmoid tanh "
    "relu relu6 gelu silu elu celu selu leaky_relu hardtanh hardswish hardsigmoid mish softplus softshrink "
    "hardshrink threshold _prelu_kernel log_sigmoid_forward rrelu_with_noise logit nan_to_num"
)
_REDUCTIONS = "sum mean amax amin max min prod nansum logsumexp cumsum cumprod norm linalg_vector_norm"
_POOLING = (
    "max_pool1d max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices avg_pool1d avg_pool2d "
    "avg_pool3d _adaptive_avg_pool2d _adaptive_avg_pool3d adaptive_max_pool2d adaptive_max_pool3d"
)
_BACKWARD_POINTWISE = (
    "threshold_backward gelu_backward silu_backward sigmoid_backward tanh_backward elu_backward "
    "leaky_relu_backward hardtanh_backward hardswish_backward hardsigmoid_backward mish_backward "
    "softplus_backward log_sigmoid_backward _prelu_kernel_backward glu_backward _softmax_backward_data "
    "_log_softmax_backward_data native_layer_norm_backward native_group_norm_backward native_batch_norm_backward "
    "cudnn_batch_norm_backward batch_norm_backward _fused_rms_norm_backward"
)
_BACKWARD_MOVEMENT = (
    "native_dropout_backward embedding_dense_backward _embedding_bag_backward max_pool2d_with_indices_backward "
    "max_pool3d_with_indices_backward avg_pool2d_backward avg_pool3d_backward _adaptive_avg_pool2d_backward "
    "_adaptive_avg_pool3d_backward adaptive_max_pool2d_backward adaptive_max_pool3d_backward "
    "upsample_nearest1d_backward upsample_nearest2d_backward upsample_nearest3d_backward "
    "upsample_linear1d_backward upsample_bilinear2d_backward upsample_trilinear3d_backward "
    "upsample_bicubic2d_backward"
)
_UPSAMPLE = {
    "upsample_nearest1d": "nearest", "upsample_nearest2d": "nearest", "upsample_nearest3d": "nearest",
    "_upsample_nearest_exact1d": "nearest", "_upsample_nearest_exact2d": "nearest",
    "_upsample_nearest_exact3d": "nearest", "upsample_linear1d": "linear", "upsample_bilinear2d": "bilinear",
    "_upsample_bilinear2d_aa": "bilinear", "upsample_trilinear3d": "trilinear",
    "upsample_bicubic2d": "bicubic", "_upsample_bicubic2d_aa": "bicubic",
}
_DENSE = {
    "mm": dense.mm_rule, "addmm": dense.addmm_rule, "_scaled_mm": dense.mm_rule, "bmm": dense.bmm_rule,
    "baddbmm": dense.baddbmm_rule, "addbmm": dense.baddbmm_rule, "mv": dense.mv_rule, "dot": dense.mv_rule,
    "vdot": dense.mv_rule, "addmv": dense.addmv_rule, "addr": dense.addmv_rule,
    "convolution": dense.convolution_rule, "_convolution": dense.convolution_rule,
    "convolution_backward": dense.convolution_backward_rule,
    "_scaled_dot_product_flash_attention_for_cpu": dense.sdpa_rule(4),
    "_scaled_dot_product_flash_attention": dense.sdpa_rule(4),
    "_scaled_dot_product_efficient_attention": dense.sdpa_rule(6),
    "_scaled_dot_product_cudnn_attention": dense.sdpa_rule(6),
    "_scaled_dot_product_fused_attention_overrideable": dense.sdpa_rule(5),
    "_flash_attention_forward": dense.flash_bshd_rule,
    "_efficient_attention_forward": dense.efficient_bshd_rule,
    "_scaled_dot_product_flash_attention_for_cpu_backward": dense.sdpa_backward_rule,
    "_scaled_dot_product_flash_attention_backward": dense.sdpa_backward_rule,
    "_scaled_dot_product_efficient_attention_backward": dense.sdpa_backward_rule,
    "_scaled_dot_product_cudnn_attention_backward": dense.sdpa_backward_rule,
    "_flash_attention_backward": dense.sdpa_bshd_backward_rule,
    "_efficient_attention_backward": dense.sdpa_bshd_backward_rule,
    "mkldnn_rnn_layer": dense.mkldnn_rnn_rule, "mkldnn_rnn_layer_backward": dense.mkldnn_rnn_backward_rule,
    "_cudnn_rnn": dense.cudnn_rnn_rule, "_cudnn_rnn_backward": dense.cudnn_rnn_backward_rule,
    "miopen_rnn": dense.miopen_rnn_rule, "_native_multi_head_attention": dense.native_mha_rule,
    "_transformer_encoder_layer_fwd": dense.native_encoder_layer_rule,
}
_OTHER = {
    "native_layer_norm": pw.layer_norm_rule, "native_group_norm": pw.group_norm_rule,
    "native_batch_norm": pw.batch_norm_rule, "cudnn_batch_norm": pw.batch_norm_rule,
    "miopen_batch_norm": pw.batch_norm_rule, "_native_batch_norm_legit": pw.batch_norm_legit_rule,
    "_native_batch_norm_legit_no_training": pw.batch_norm_eval_rule,
    "_batch_norm_with_update": pw.batch_norm_train_rule, "_batch_norm_no_update": pw.batch_norm_eval_rule,
    "_fused_rms_norm": pw.rms_norm_rule, "_softmax": pw.per_output(1), "_log_softmax": pw.per_output(1),
    "_safe_softmax": pw.per_output(1), "native_dropout": pw.native_dropout_rule, "embedding": pw.zero_rule,
    "_embedding_bag": pw.embedding_bag_rule, "_embedding_bag_forward_only": pw.embedding_bag_rule,
    "addcmul": pw.per_output(2), "addcmul_": pw.per_output(2), "addcdiv": pw.per_output(2),
    "addcdiv_": pw.per_output(2), "lerp": pw.per_output(3), "lerp_": pw.per_output(3),
    "glu": pw.per_output(2), "var": pw.per_input(2), "std": pw.per_input(2), "var_mean": pw.per_input(2),
    "std_mean": pw.per_input(2),
}


def _resolve(name: str) -> Any:
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


def _build() -> dict[Any, Any]:
    named: dict[str, Any] = {}
    for name in _ARITHMETIC.split():
        named[name] = named[name + "_"] = pw.per_output(1)
    for name in _REDUCTIONS.split() + _POOLING.split():
        named[name] = pw.per_input(1)
    for name in _BACKWARD_POINTWISE.split():
        named[name] = pw.per_input(2)
    for name in _BACKWARD_MOVEMENT.split():
        named[name] = pw.per_input(1)
    for name, mode in _UPSAMPLE.items():
        named[name] = pw.upsample_rule(mode)
    named.update(_DENSE)
    named.update(_OTHER)
    table = {}
    for name, rule in named.items():
        packet = _resolve(name)
        if packet is not None:
            table[packet] = rule
    return table


RULES: dict[Any, Any] = _build()
MATMUL_FAMILY = frozenset(_resolve(name) for name in _DENSE) - {None}


def op_cost(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int] | None:
    """(MACs, FLOPs) of one aten call, or None when the op is free (not in the table)."""
    rule = RULES.get(func._overloadpacket)
    if rule is None:
        return None
    return rule(args, kwargs, out)

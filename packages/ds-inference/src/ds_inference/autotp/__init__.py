"""AutoTP: automatic tensor-parallel sharding of Hugging Face-style models, for inference and training.

``autotp_shard(model, tp_group)`` replaces the linears (and embedding/output head) in place by the sharded
layers of :mod:`ds_inference.autotp._layers`; ``tp_plan(model)`` says which parameter is split along which
dimension; ``full_state_dict`` / ``load_full_state_dict`` move between full and sharded weights.
"""

from ds_inference.autotp._layers import (
    Conv_LinearALlreduce,
    EmbeddingLayer,
    HiddenParallelEmbedding,
    LinearAllreduce,
    LinearLayer,
    LmHeadLinearAllreduce,
    Normalize,
    TensorParallel_Layer,
    VocabParallelEmbedding,
    conv_LinearLayer,
)
from ds_inference.autotp._mode import get_auto_tp_mode, is_autotp_training_mode, set_autotp_mode
from ds_inference.autotp._policy import Placement
from ds_inference.autotp._replace import AutoTP, replace_transformer_layer, revert_transformer_layer
from ds_inference.autotp._shard import autotp_shard, full_state_dict, load_full_state_dict, tp_layers, tp_plan
from ds_inference.autotp._specs import (
    AutoTPConfig,
    AutoTPPresets,
    PartitionType,
    TPLayerSpec,
    hf_tp_plan_specs,
    merge_autotp_configs,
)
from ds_inference.autotp._subparam_layers import (
    GateUpPack_LinearLayer,
    SubParamLinearAllreduce,
    SubParamLinearLayer,
    Yuan_LinearAllreduce,
    Yuan_LinearLayer,
    fused_LinearLayer,
)
from ds_inference.autotp.sharding import ShardLayout, ShardMeta, make_layout, shard_sizes

__all__ = [
    "AutoTP", "AutoTPConfig", "AutoTPPresets", "Conv_LinearALlreduce", "EmbeddingLayer", "GateUpPack_LinearLayer",
    "HiddenParallelEmbedding", "SubParamLinearAllreduce", "SubParamLinearLayer", "Yuan_LinearAllreduce",
    "Yuan_LinearLayer", "fused_LinearLayer",
    "LinearAllreduce", "LinearLayer", "LmHeadLinearAllreduce", "Normalize", "PartitionType", "Placement",
    "ShardLayout", "ShardMeta", "TPLayerSpec", "TensorParallel_Layer", "VocabParallelEmbedding", "autotp_shard",
    "conv_LinearLayer", "full_state_dict", "get_auto_tp_mode", "hf_tp_plan_specs", "is_autotp_training_mode",
    "load_full_state_dict", "make_layout", "merge_autotp_configs", "replace_transformer_layer",
    "revert_transformer_layer", "set_autotp_mode", "shard_sizes", "tp_layers", "tp_plan",
]

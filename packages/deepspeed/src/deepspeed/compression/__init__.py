"""``deepspeed.compression``: compression-aware training (DeepSpeed Compression's ``compression_training``).

``init_compression(model, ds_config, teacher_model=None)`` prepares a model (layer reduction from a teacher; the
configured Linear/Conv2d/Embedding layers converted to compression-aware layers), ``compression_scheduler``
switches weight/activation quantization and sparse/row/head/channel pruning on at their ``schedule_offset``
(``deepspeed.initialize`` builds and steps one when the config has ``compression_training``), and
``redundancy_clean(model, ds_config)`` bakes the result in and physically shrinks the pruned layers.
"""

from deepspeed.compression.basic_layer import (
    BNLayer_Compress,
    Conv2dLayer_Compress,
    Embedding_Compress,
    LinearLayer_Compress,
    QuantAct,
)
from deepspeed.compression.compress import init_compression, redundancy_clean, student_initialization
from deepspeed.compression.helper import convert_conv1d_to_linear, recursive_getattr, recursive_setattr
from deepspeed.compression.scheduler import compression_scheduler

__all__ = [
    "BNLayer_Compress",
    "Conv2dLayer_Compress",
    "Embedding_Compress",
    "LinearLayer_Compress",
    "QuantAct",
    "compression_scheduler",
    "convert_conv1d_to_linear",
    "init_compression",
    "recursive_getattr",
    "recursive_setattr",
    "redundancy_clean",
    "student_initialization",
]

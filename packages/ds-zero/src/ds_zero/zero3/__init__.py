"""ZeRO stage 3: partitioned parameters gathered per module by hooks (the FSDP2 way), one file per concept.

- ``param``: a partitioned parameter's state (``ds_*`` attributes, its partition);
- ``_collectives``: gathering whole values and broadcasting modified ones;
- ``schedule``: which module gathers and releases what, and when (module hooks, external parameters);
- ``_prefetch``: the recorded trace that drives prefetch and reuse;
- ``_reduce_scatter``: gradients into partitions during backward;
- ``optimizer``: the ZeRO-3 optimizer wrapper; ``checkpoint``: its state dict;
- ``init``: ``zero.Init``, ``GatheredParameters``, external parameters; ``leaf``: leaf modules;
- ``tiled_linear``: ``TiledLinear``; ``mics``: ``MiCS_Init`` (MiCS shard groups, with ``ds_zero.zeropp``).
"""

from ds_zero.zero3.init import GatheredParameters, Init, register_external_parameter, unregister_external_parameter
from ds_zero.zero3.leaf import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from ds_zero.zero3.mics import MiCS_Init
from ds_zero.zero3.param import ZeroParamStatus, is_partitioned
from ds_zero.zero3.tiled_linear import TiledLinear, TiledLinearReturnBias

__all__ = [
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "TiledLinear",
    "TiledLinearReturnBias",
    "ZeroParamStatus",
    "get_z3_leaf_modules",
    "is_partitioned",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "unregister_external_parameter",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]

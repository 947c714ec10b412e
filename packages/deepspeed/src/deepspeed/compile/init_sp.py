"""``init_autosp``: DeepSpeed's AutoSP backend for ``torch.compile``.

The backend runs AutoSP's graph passes (``passes.sp_compile.apply_autosp``: the whole, tagged sequence enters the
graph, the graph shards it) on the graph Dynamo captured, then AutoSP's memory optimization (selective activation
checkpointing, ``passes.long_context_checkpointing``), then the compiler (Inductor unless ``backend`` names another
Dynamo backend). Compile with ``dynamic=True`` or tag and mark the inputs with ``prepare_autosp_inputs``, so the
sequence length is a symbol the passes can divide, and with ``fullgraph=True``. ``DeepSpeedEngine.compile`` with
``compile: {deepcompile: true, passes: ["autosp"]}`` runs the same passes over the engine's sequence groups
(``compile.engine``); both give each rank the loss of its shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule

from deepspeed.compile.custom_ops.sp_compat import check_autosp_compatibility
from deepspeed.compile.custom_ops.sp_dp_registry import extract_mesh_size
from deepspeed.compile.passes import long_context_checkpointing
from deepspeed.compile.passes.sp_compile import apply_autosp


def init_autosp(config: Any, backend: Any = "inductor") -> Any:
    """A ``torch.compile`` backend applying AutoSP over the mesh of ``config`` (a DeepSpeed config object or
    dict: ``sequence_parallel_size`` ranks per sequence group, the world divided by it as data parallel)."""
    check_autosp_compatibility()
    params = config if isinstance(config, dict) else getattr(config, "_param_dict", None)
    if not isinstance(params, dict):
        raise TypeError("init_autosp: config must be a DeepSpeed config (with _param_dict) or a dict, got "
                        f"{type(config).__name__}")
    sp_size, dp_size = extract_mesh_size(params)
    long_context_checkpointing.register_long_context_checkpointing()
    compiler = backend if callable(backend) else None

    def backend_fn(gm: GraphModule, real_inputs: list) -> Any:
        apply_autosp(gm, real_inputs, debug=False, sp_size=sp_size, dp_size=dp_size)
        if long_context_checkpointing.enabled:
            gm = long_context_checkpointing.selective_checkpoint(gm)
        inner = compiler if compiler is not None else torch._dynamo.lookup_backend(backend)
        return inner(gm, real_inputs)

    return backend_fn

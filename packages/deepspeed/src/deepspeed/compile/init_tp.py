"""Set-up of DeepCompile's AutoTP pass (``compile: {deepcompile: true, passes: ["autotp"]}``).

The model arrives already partitioned by the engine's AutoTP (``tensor_parallel.autotp_size``).
:func:`init_autotp` checks the pass can capture it, hands the layers' collectives over to the graph
(``passes.tp_compile.defer_collectives_to_compiler``) and returns the ``torch.compile`` backend that inserts them
(``passes.tp_compile.apply_autotp``) before the inner compiler. Gradients are still reduced over the data-parallel
group by the engine: the pass only sums partial results inside each tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.fx import GraphModule
from torch.torch_version import TorchVersion

from deepspeed.utils.torch import required_torch_version

from .passes.tp_compile import apply_autotp, defer_collectives_to_compiler

AUTOTP_MIN_TORCH_VERSION = 2.6
# transformers releases whose batched_mm experts forward mutates the routing tensor in place
# (huggingface/transformers#45621, fixed by #45634): [first broken, first fixed)
BROKEN_TRANSFORMERS_MOE_VERSIONS = ("5.8.0", "5.10.1")
# passes the AutoTP pass cannot share a compile with yet (their graphs are built by a different backend)
_NOT_COMBINABLE = ("autosp", "z1", "z3")


def check_autotp_passes(passes: Iterable[str] | None) -> None:
    """Refuse ``autotp`` together with AutoSP or a ZeRO pass (NotImplementedError naming them)."""
    passes = list(passes or [])
    others = [p for p in passes if p in _NOT_COMBINABLE]
    if "autotp" in passes and others:
        raise NotImplementedError(f"compile.passes={passes}: the AutoTP compile pass cannot yet be combined with "
                                  f"AutoSP or the ZeRO passes ({others}); run 'autotp' on its own")


def _experts_modules_on_batched_mm(model: torch.nn.Module) -> list[str]:
    # transformers' experts-implementation decorator leaves _apply_gate and is_concatenated on the module
    return [name for name, module in model.named_modules()
            if hasattr(module, "_apply_gate") and hasattr(module, "is_concatenated")
            and getattr(getattr(module, "config", None), "_experts_implementation", None) == "batched_mm"]


def _check_broken_transformers_moe(model: torch.nn.Module) -> None:
    """Refuse a MoE model routed through the batched_mm experts of a transformers release that mutates the
    routing tensor in place (no full graph can capture that)."""
    try:
        import transformers
    except ImportError:
        return
    first_broken, first_fixed = BROKEN_TRANSFORMERS_MOE_VERSIONS
    installed = TorchVersion(transformers.__version__)  # PEP 440 ordering (the project's version comparator)
    if not first_broken <= installed < first_fixed:
        return
    found = _experts_modules_on_batched_mm(model)
    if found:
        raise RuntimeError(
            f"transformers {transformers.__version__} mutates the MoE routing tensor in place in its batched_mm "
            f"experts forward (huggingface/transformers#45621, fixed by #45634); '{found[0]}' uses it, so the "
            f"AutoTP compile pass cannot capture a full graph. Upgrade to transformers >= {first_fixed} or select "
            "another experts implementation (eager, grouped_mm).")


def _check_autotp_compatibility(model: torch.nn.Module) -> None:
    if not required_torch_version(min_version=AUTOTP_MIN_TORCH_VERSION):
        raise RuntimeError(f"The AutoTP compile pass requires PyTorch >= {AUTOTP_MIN_TORCH_VERSION}, found "
                           f"{torch.__version__}")
    _check_broken_transformers_moe(model)


def init_autotp(model: torch.nn.Module, compile_fn: Callable[[GraphModule, list], Any] | None = None):
    """Prepare ``model`` (already AutoTP-partitioned) and return a ``torch.compile`` backend that emits its
    tensor-parallel collectives into the graph, then compiles with ``compile_fn`` (inductor by default)."""
    _check_autotp_compatibility(model)
    defer_collectives_to_compiler(model)

    def autotp_backend(gm: GraphModule, example_inputs: list) -> Any:
        apply_autotp(gm, example_inputs)
        if compile_fn is None:
            return torch._inductor.compile(gm, example_inputs)
        return compile_fn(gm, example_inputs)

    return autotp_backend


def compile_autotp(engine: Any, backend: Any, kwargs: dict[str, Any]) -> None:
    """``engine.compile`` with ``passes: ["autotp"]``: compile ``engine.module`` (one full graph) through the
    AutoTP backend, with ``backend`` (a name or a compiler callable) as the inner compiler."""
    check_autotp_passes(engine._config.compile.passes)
    if kwargs.get("fullgraph", True) is not True:
        raise ValueError("engine.compile: the AutoTP pass needs the whole forward as one graph (a layer left outside "
                         "it would lose its backward collective); drop fullgraph=False from compile_kwargs")
    if backend == "inductor":
        inner = None
    elif callable(backend):
        inner = backend
    else:
        inner = torch._dynamo.lookup_backend(backend)
    module = engine.module
    autotp_backend = init_autotp(module, inner)
    # forward only: the module's hooks (e.g. AutoTP's first-step input check, a collective over Python
    # objects) stay eager around the one compiled graph
    module.forward = torch.compile(module.forward, backend=autotp_backend, **{**kwargs, "fullgraph": True})

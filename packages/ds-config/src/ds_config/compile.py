"""``compile`` section: ``torch.compile`` and DeepCompile (incl. AutoSP passes)."""

from __future__ import annotations

from typing import Any, Literal

from ds_config._base import DSConfigModel
from ds_config._types import Bool, NonNeg


class CompileConfig(DSConfigModel):
    """``compile``: compiler integration of the engine."""

    enabled: Bool = False
    """Compile the model with ``torch.compile`` at ``initialize``."""
    backend: str = "inductor"
    """``torch.compile`` backend."""
    kwargs: dict[str, Any] = {}
    """Extra keyword arguments for ``torch.compile``."""
    deepcompile: Bool = False
    """Enable DeepCompile (compiler-driven ZeRO optimisations)."""
    passes: list[Literal["z1", "z3", "autosp", "autotp"]] | None = None
    """DeepCompile passes to run (DeepSpeed's pass names), e.g. ``["autosp"]`` for automatic sequence
    parallelism."""
    free_activation: Bool = False
    offload_activation: Bool = False
    offload_opt_states: Bool = False
    double_buffer: Bool = True
    symmetric_memory: Bool = False
    debug_log: Bool = False
    offload_parameters: Bool = False
    sync_before_reduce: Bool = False
    sync_after_reduce: Bool = False
    sync_before_allgather: Bool = False
    sync_after_allgather: Bool = False
    keep_int_input_tensors: Bool = True
    keep_all_input_tensors: Bool = False
    free_activation_threshold: NonNeg = 10 * 1024 * 1024
    """Bytes; activations at least this large are freed eagerly (DeepCompile's free-activation mode)."""
    offload_activation_pin_memory: Bool = True

    @property
    def autosp(self) -> bool:
        """AutoSP (compiler-based sequence parallelism) is requested."""
        return self.deepcompile and "autosp" in (self.passes or [])

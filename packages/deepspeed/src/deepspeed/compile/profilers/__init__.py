"""DeepCompile profilers: per-node run time, memory and output size of a graph (``graph_profile``) and the
all-gather cost model the prefetch pass plans with (``comm_profile``). ``ProfilingResult`` is what the profilers
leave for the passes, one per graph id."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import Graph


@dataclass
class ProfilingResult:
    """Profile of one compiled graph (forward and its backward), read by the scheduling passes.

    Memory records are ``(node name, allocated bytes after the node, change in bytes, peak bytes during it)``;
    time records ``(node name, device ms, wall ms)``; tensor sizes ``(node name, output bytes)``. A ``*_mem_complete``
    flag is False when the memory profile stopped early (a node failed on some rank): passes must not plan from it.
    """

    fwd_graph: Graph | None = None
    bwd_graph: Graph | None = None
    needs_backward: bool = False
    # How many forward outputs the caller receives; the forward graph's later outputs are saved for backward.
    # None until the joint graph has been partitioned.
    num_fwd_outputs: int | None = None
    fwd_mem: list[tuple[str, int, int, int]] = field(default_factory=list)
    bwd_mem: list[tuple[str, int, int, int]] = field(default_factory=list)
    fwd_mem_complete: bool = True
    bwd_mem_complete: bool = True
    fwd_time: list[tuple[str, float, float]] = field(default_factory=list)
    bwd_time: list[tuple[str, float, float]] = field(default_factory=list)
    fwd_tensor_sizes: list[tuple[str, int]] = field(default_factory=list)
    bwd_tensor_sizes: list[tuple[str, int]] = field(default_factory=list)
    # (index of the graph input, ds_id, partitioned shape) for every ZeRO-3 parameter input.
    param_indices: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)


__all__ = ["ProfilingResult"]

"""The profiled module tree: per-module numbers (params, MACs, FLOPs, latency, FLOPS, shares), rendered like
``print(model)`` with the profile in front of each module's own description, or exported as plain data."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from ds_profiler._counter import ModuleStats, Recorder
from ds_profiler._format import duration_to_string, flops_to_string, macs_to_string, params_to_string


def param_count(module: nn.Module) -> int:
    """Parameters stored in ``module`` and its submodules, each shared tensor once. A ZeRO-3 partitioned
    parameter counts its full size (``ds_numel``), not the local shard."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


@dataclass
class Totals:
    """Whole-model figures used for the shares: params (count), macs, flops, duration (seconds)."""

    params: int
    macs: int
    flops: int
    duration: float


def totals_of(model: nn.Module, recorder: Recorder) -> Totals:
    """The root module's inclusive figures."""
    root = recorder.modules.get(model, ModuleStats())
    return Totals(param_count(model), root.macs, root.flops, root.duration)


def children(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Registered children in order (``None`` entries, which ``nn.Module`` allows, are skipped)."""
    for name, child in module._modules.items():
        if child is not None:
            yield name, child


def stats_of(module: nn.Module, recorder: Recorder) -> ModuleStats:
    """A module's figures. A container that is never called itself (``nn.ModuleList``, ``nn.ModuleDict``)
    shows the sum of its children, whose calls its caller made directly."""
    stats = recorder.modules.get(module)
    if stats is not None and stats.calls:
        return stats
    kids = [stats_of(child, recorder) for _, child in children(module)]
    if not kids:
        return stats if stats is not None else ModuleStats()
    total = ModuleStats(ignored=stats.ignored if stats is not None else False)
    for kid in kids:
        total.macs += kid.macs
        total.flops += kid.flops
        total.duration += kid.duration
        total.backward_macs += kid.backward_macs
        total.backward_flops += kid.backward_flops
    return total


def _share(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, 2) if whole else 0:g}%"


def profile_line(module: nn.Module, recorder: Recorder, totals: Totals) -> str:
    """``params = share Params, MACs = share MACs, latency = share latency, FLOPS`` for one module."""
    stats = stats_of(module, recorder)
    params = param_count(module)
    throughput = stats.flops / stats.duration if stats.duration else 0.0
    items = [
        f"{params_to_string(params)} = {_share(params, totals.params)} Params",
        f"{macs_to_string(stats.macs)} = {_share(stats.macs, totals.macs)} MACs",
        f"{duration_to_string(stats.duration)} = {_share(stats.duration, totals.duration)} latency",
        flops_to_string(throughput),
    ]
    if recorder.backward.calls:
        items.append(f"{macs_to_string(stats.backward_macs)} bwd")
    if stats.ignored:
        items.append("ignored")
    return ", ".join(items)


def _indent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    return "\n".join([lines[0]] + [" " * spaces + line for line in lines[1:]])


def render(module: nn.Module, recorder: Recorder, totals: Totals, max_depth: int, depth: int = 0) -> str:
    """``repr(module)``'s layout with each module's profile first; children deeper than ``max_depth``
    (-1: no limit) are left out."""
    own = module.extra_repr()
    extra = [profile_line(module, recorder, totals) + (f", {own}" if own and "\n" not in own else "")]
    if own and "\n" in own:
        extra.extend(own.split("\n"))
    child_lines = []
    if max_depth < 0 or depth < max_depth:
        for name, child in children(module):
            child_lines.append(f"({name}): " + _indent(render(child, recorder, totals, max_depth, depth + 1), 2))
    lines = extra + child_lines
    if len(lines) == 1:
        return f"{module._get_name()}({lines[0]})"
    return f"{module._get_name()}(\n  " + "\n  ".join(lines) + "\n)"


def to_dict(module: nn.Module, recorder: Recorder, name: str = "", depth: int = 0) -> dict[str, Any]:
    """The whole tree as plain data (JSON-ready); durations in seconds, throughput in FLOP/s (forward);
    ``backward_*`` hold the backward work of the autograd nodes each module's forward created."""
    stats = stats_of(module, recorder)
    return {
        "name": name,
        "type": type(module).__name__,
        "depth": depth,
        "params": param_count(module),
        "macs": stats.macs,
        "flops": stats.flops,
        "duration_s": stats.duration,
        "flops_per_s": stats.flops / stats.duration if stats.duration else 0.0,
        "backward_macs": stats.backward_macs,
        "backward_flops": stats.backward_flops,
        "calls": stats.calls,
        "ignored": stats.ignored,
        "children": [
            to_dict(child, recorder, f"{name}.{key}" if name else key, depth + 1) for key, child in children(module)
        ],
    }


def aggregate_by_depth(model: nn.Module, recorder: Recorder) -> list[dict[str, list[float]]]:
    """Per depth, per module class name: summed [MACs, params, latency seconds]."""
    levels: list[dict[str, list[float]]] = []

    def visit(module: nn.Module, depth: int) -> None:
        if depth == len(levels):
            levels.append({})
        stats = stats_of(module, recorder)
        row = levels[depth].setdefault(module._get_name(), [0, 0, 0.0])
        row[0] += stats.macs
        row[1] += param_count(module)
        row[2] += stats.duration
        for _, child in children(module):
            visit(child, depth + 1)

    visit(model, 0)
    return levels


def aggregated_lines(model: nn.Module, recorder: Recorder, module_depth: int, top_modules: int) -> list[str]:
    """The top ``top_modules`` classes by params, MACs and latency at each depth 0..``module_depth``."""
    levels = aggregate_by_depth(model, recorder)
    last = len(levels) - 1 if module_depth < 0 else min(module_depth, len(levels) - 1)
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    formatters = (("params", 1, params_to_string), ("MACs", 0, macs_to_string), ("fwd latency", 2,
                                                                                 duration_to_string))
    for depth in range(last + 1):
        lines.append(f"depth {depth}:")
        for label, index, fmt in formatters:
            ranked = sorted(levels[depth].items(), key=lambda item: item[1][index], reverse=True)[:top_modules]
            shown = {name: fmt(values[index]) for name, values in ranked}
            lines.append(f"    {label:<11} - {shown}")
    return lines

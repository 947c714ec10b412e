"""ZeRO-3 model-states memory estimate (params, gradients, Adam states; activations not included).

Per GPU, with Ψ parameters, L parameters in the largest layer and N GPUs in total, every case first needs
4L bytes to gather the largest layer (its fp16 params and fp16 grads), plus:
  - params and optimizer offloaded to CPU: nothing more;
  - optimizer offloaded, params not: the fp16 param partition, 2Ψ / N;
  - nothing offloaded: fp16 params plus fp32 params, grads, momentum and variance, 18Ψ / N.
Per node (n GPUs there, buffer factor b, g = n / N the node's share of the partitions): without
``zero.Init`` each local process first builds the whole fp32 model (4Ψ·n); with it only the largest layer is
ever whole (4L·n). Offloaded states add 18Ψ·g (params too) or 16Ψ·g (optimizer only).
"""

from __future__ import annotations

from torch import nn

from ds_zero.estimate._count import count_largest_layer_params, count_total_params
from ds_zero.estimate._table import (
    EstimateRow,
    check_buffer_factor,
    check_count,
    check_largest_layer,
    check_positive_int,
    render_table,
)

# (offload_param, offload_optimizer) in the documented table order; params offloaded without the optimizer
# is not a ZeRO-3 configuration.
_OFFLOAD_CASES = (("cpu", "cpu"), ("none", "cpu"), ("none", "none"))


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """``(total_params, largest_layer_params)`` of ``model`` (shared parameters counted once)."""
    return count_total_params(model), count_largest_layer_params(model)


def _offloaded_cpu_mem(total_params: float, local_processes: float, states_factor: float,
                       gpus_factor: float, zero_init: bool) -> float:
    """Node RAM, before the buffer factor, when model states live on the CPU."""
    if zero_init:
        return total_params * states_factor * gpus_factor
    return total_params * max(local_processes, states_factor * gpus_factor)


def estimate_zero3_model_states_mem_needs(total_params: float, largest_layer_params: float,
                                          num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True, cpu_offload_params: bool = True,
                                          zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[float, float, float]:
    """``(cpu_mem, gpu_mem, largest_layer_memory)`` in bytes: RAM per node, memory per GPU and the part of
    it needed to gather the largest layer. ``cpu_offload_params`` only counts when ``cpu_offload`` is set."""
    total_params = check_count("total_params", total_params)
    largest_layer_params = check_largest_layer(largest_layer_params, total_params)
    num_gpus_per_node = check_positive_int("num_gpus_per_node", num_gpus_per_node)
    num_nodes = check_positive_int("num_nodes", num_nodes)
    factor = check_buffer_factor(additional_buffer_factor)
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = num_gpus_per_node / total_gpus
    largest_layer_memory = 4 * largest_layer_params
    fp32_builds = 4 * num_gpus_per_node  # bytes per param while every local process holds an fp32 copy
    if cpu_offload and cpu_offload_params:
        gpu_mem = largest_layer_memory
        cpu_mem = _offloaded_cpu_mem(total_params, fp32_builds, 18, gpus_factor, zero_init) * factor
    elif cpu_offload:
        gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
        cpu_mem = _offloaded_cpu_mem(total_params, fp32_builds, 16, gpus_factor, zero_init) * factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu_mem = (largest_layer_params if zero_init else total_params) * fp32_builds * factor
    return cpu_mem, gpu_mem, largest_layer_memory


def zero3_estimate_rows(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                        num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> list[EstimateRow]:
    """The ZeRO-3 table's six rows without printing, in the documented order."""
    rows = []
    for offload_param, offload_optimizer in _OFFLOAD_CASES:
        for zero_init in (True, False):
            cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                cpu_offload=offload_optimizer == "cpu", cpu_offload_params=offload_param == "cpu",
                zero_init=zero_init, additional_buffer_factor=additional_buffer_factor)
            rows.append(EstimateRow(3, cpu_mem, gpu_mem, offload_optimizer, offload_param, zero_init))
    return rows


def format_zero3_estimate(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                          num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> tuple[str, list[EstimateRow]]:
    """The printed ZeRO-3 table and its rows."""
    rows = zero3_estimate_rows(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                               additional_buffer_factor)
    text = render_table(rows, total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    return text, rows


def estimate_zero3_model_states_mem_needs_all_cold(total_params: float, largest_layer_params: float,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> list[EstimateRow]:
    """Print the ZeRO-3 table from parameter counts alone (no model needed); return its rows."""
    text, rows = format_zero3_estimate(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                                       additional_buffer_factor)
    print(text)
    return rows


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> list[EstimateRow]:
    """Print the ZeRO-3 table for ``model`` (its parameters counted, meta-device models included)."""
    total_params, largest_layer_params = model_to_params(model)
    return estimate_zero3_model_states_mem_needs_all_cold(
        total_params, largest_layer_params, num_gpus_per_node, num_nodes, additional_buffer_factor)

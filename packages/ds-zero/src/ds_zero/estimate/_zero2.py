"""ZeRO-2 model-states memory estimate (params, gradients, Adam states; activations not included).

Per GPU, with Ψ parameters and N GPUs in total:
  - optimizer offloaded to CPU: the fp16 params stay on the GPU: 2Ψ bytes;
  - no offload: fp16 params and gradients (4Ψ) plus the partitioned fp32 master weights, momentum,
    variance and gradients (16Ψ / N).
Per node (n GPUs there, buffer factor b): the model is first built in fp32 by each of the n local
processes (4Ψ·n); with CPU offload the node also holds the 16Ψ fp32 optimizer states, whichever is larger.
"""

from __future__ import annotations

from torch import nn

from ds_zero.estimate._count import count_total_params
from ds_zero.estimate._table import (
    EstimateRow,
    check_buffer_factor,
    check_count,
    check_positive_int,
    render_table,
)


def model_to_params(model: nn.Module) -> int:
    """Total distinct parameters of ``model`` (shared parameters counted once)."""
    return count_total_params(model)


def estimate_zero2_model_states_mem_needs(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[float, float]:
    """``(cpu_mem, gpu_mem)`` in bytes: general RAM per node and memory per GPU for ZeRO-2."""
    total_params = check_count("total_params", total_params)
    num_gpus_per_node = check_positive_int("num_gpus_per_node", num_gpus_per_node)
    num_nodes = check_positive_int("num_nodes", num_nodes)
    additional_buffer_factor = check_buffer_factor(additional_buffer_factor)
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * num_gpus_per_node, 16) * additional_buffer_factor
    else:
        gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return cpu_mem, gpu_mem


def zero2_estimate_rows(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                        additional_buffer_factor: float = 1.5) -> list[EstimateRow]:
    """The ZeRO-2 table's rows without printing: optimizer offloaded to CPU, then not offloaded."""
    rows = []
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor)
        rows.append(EstimateRow(2, cpu_mem, gpu_mem, "cpu" if cpu_offload else "none"))
    return rows


def format_zero2_estimate(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                          additional_buffer_factor: float = 1.5) -> tuple[str, list[EstimateRow]]:
    """The printed ZeRO-2 table and its rows."""
    rows = zero2_estimate_rows(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    return render_table(rows, total_params, num_gpus_per_node, num_nodes), rows


def estimate_zero2_model_states_mem_needs_all_cold(total_params: float, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> list[EstimateRow]:
    """Print the ZeRO-2 table for a model of ``total_params`` parameters (no model needed); return its rows."""
    text, rows = format_zero2_estimate(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    print(text)
    return rows


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> list[EstimateRow]:
    """Print the ZeRO-2 table for ``model`` (its parameters counted, meta-device models included)."""
    return estimate_zero2_model_states_mem_needs_all_cold(
        model_to_params(model), num_gpus_per_node, num_nodes, additional_buffer_factor)

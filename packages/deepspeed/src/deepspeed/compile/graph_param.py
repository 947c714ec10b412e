"""The ZeRO parameters among a compiled graph's inputs: which placeholders they are, their whole shapes and ids,
and (once the backward graph exists) which backward inputs and gradient outputs belong to them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, Node

from deepspeed.compile.fx import get_output_node
from deepspeed.compile.util import get_input_nodes, get_param_nodes


@dataclass
class DSGraphParam:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    node: Node
    allgather_node: Node | None
    release_node: Node | None
    param: torch.Tensor
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = math.prod(self.shape)


class DSGraphParamManager:
    """Parameters of one forward graph; ``index_to_ds_ids``: ``(input index, ds_id, whole shape)`` per parameter."""

    def __init__(self, fw_graph: Graph, sample_inputs: Any, index_to_ds_ids: list[tuple[int, int, Any]]) -> None:
        self._fw_graph = fw_graph
        self._bw_graph: Graph | None = None
        nodes = get_param_nodes(fw_graph, index_to_ds_ids)
        self._param_names = [n.name for n in nodes]
        self._param_indices = [i for i, _, _ in index_to_ds_ids]
        self._params: dict[str, DSGraphParam] = {}
        self._ds_ids: dict[str, int] = {}
        for node, (i, ds_id, shape) in zip(nodes, index_to_ds_ids, strict=False):
            value = sample_inputs[i]
            self._params[node.name] = DSGraphParam(node.name, shape, value.dtype, value.device, node, None, None,
                                                   value)
            self._ds_ids[node.name] = ds_id

    def get_bwd_mapping(self, bw_graph: Graph) -> tuple[list[Node], dict[str, Any]]:
        """``(backward placeholders that are parameters, parameter name -> its gradient output)``."""
        self._bw_graph = bw_graph
        outputs = get_output_node(bw_graph).args[0]
        nodes = [n for n in bw_graph.nodes if n.name in self._param_names]
        grads = {name: outputs[i] for name, i in zip(self._param_names, self._param_indices, strict=False)}
        return nodes, grads

    @property
    def param_names(self) -> list[str]:
        return self._param_names

    @property
    def params(self) -> dict[str, DSGraphParam]:
        return self._params

    @property
    def ds_ids(self) -> dict[str, int]:
        return self._ds_ids

    def get_grad_name(self, param_name: str) -> Any:
        if self._bw_graph is None:
            raise RuntimeError("DSGraphParamManager.get_grad_name: no backward graph mapped yet (get_bwd_mapping)")
        return self.get_bwd_mapping(self._bw_graph)[1][param_name]

    def replace_fake_tensors_with_real_params(self, sample_inputs: list[Any], bw_graph: Graph) -> list[Any]:
        """``sample_inputs`` of the backward graph with its parameter inputs replaced by the real parameters."""
        replaced = list(sample_inputs)
        names = {n.name for n in self.get_bwd_mapping(bw_graph)[0]}
        for i, node in enumerate(get_input_nodes(bw_graph)):
            if node.name in names:
                replaced[i] = self._params[node.name].param
        return replaced

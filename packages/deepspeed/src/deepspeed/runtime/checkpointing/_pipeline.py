"""Pipeline layer files: ``layer_XX-model_YY-model_states.pt``, one per layer, written in parallel on request.

A pipeline stage keeps its weights per layer (so a checkpoint can be re-partitioned into different stages)
instead of in the model-states file. With ``checkpoint.parallel_write.pipeline_stage`` the stage's layers are
spread over its data-parallel ranks, each writing a contiguous run; without it data-parallel rank 0 writes
all of them. Every rank of the stage reads all of its layers back, and checks them against its layers before
any is loaded (``prepare_load``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from deepspeed.runtime.checkpointing._state import ShardContext
from deepspeed.runtime.checkpointing.checks import check_module_weights
from deepspeed.runtime.checkpointing.errors import CheckpointError
from deepspeed.runtime.checkpointing.layout import layer_states_name, pipeline_layer_range
from deepspeed.runtime.checkpointing.serialize import module_state_dict


class PipelineLayerShards:
    """A :class:`CheckpointShards` extension for one pipeline stage.

    ``layers``: ``(global layer index, layer module)`` for the stage's layers that have a state dict (DeepSpeed
    writes every ``nn.Module`` layer, parameter-free ones too, and skips plain functions), in order.
    ``file_name(index)``: the layer's file name inside the tag directory (default
    ``layer_XX-model_YY-model_states.pt`` with this rank's model-parallel rank; the pipeline engine passes
    ``PipelineModule.ckpt_layer_path``'s, which has no ``-model_YY`` part without a model axis).
    """

    owns_optimizer_state = False
    owns_module_state = True

    def __init__(self, layers: Sequence[tuple[int, torch.nn.Module]],
                 file_name: Callable[[int], str] | None = None) -> None:
        indices = [index for index, _ in layers]
        if len(set(indices)) != len(indices) or any(index < 0 for index in indices):
            raise ValueError(f"PipelineLayerShards: layer indices must be distinct and >= 0, got {indices}")
        self.layers = list(layers)
        self.file_name = file_name

    def _name(self, index: int, ctx: ShardContext) -> str:
        return self.file_name(index) if self.file_name is not None else layer_states_name(index, ctx.parallel.mp_rank)

    def model_state_extras(self) -> Mapping[str, Any]:
        return {}

    def files_to_save(self, ctx: ShardContext) -> Mapping[str, Any]:
        """This rank's run of layers (all of them on data-parallel rank 0 without parallel writes)."""
        mine = pipeline_layer_range(len(self.layers), ctx.parallel.dp_rank, ctx.parallel.dp_world_size,
                                    ctx.config.parallel_write.pipeline_stage)
        return {
            self._name(index, ctx): module_state_dict(layer, ctx.exclude_frozen_parameters)
            for index, layer in self.layers[mine.start:mine.stop]
        }

    def load_files(self, ctx: ShardContext, load: Callable[[str], Any]) -> None:
        self.prepare_load(ctx, load)()

    def prepare_load(self, ctx: ShardContext, load: Callable[[str], Any]) -> Callable[[], None]:
        """Read every layer file of the stage and check it fits its layer (keys under ``load_module_strict``,
        shapes), changing nothing; returns the step that loads them (or hands them to ``custom_load_fn``)."""
        read = []
        for index, layer in self.layers:
            name = self._name(index, ctx)
            weights = load(name)
            if ctx.custom_load_fn is None:
                check_module_weights(layer, weights, ctx.load_module_strict, os.path.join(ctx.tag_dir, name),
                                     what=f"layer {index}")
            read.append((index, layer, name, weights))

        def apply() -> None:
            for index, layer, name, weights in read:
                if ctx.custom_load_fn is not None:
                    ctx.custom_load_fn(src=weights, dst=layer)
                    continue
                try:
                    layer.load_state_dict(weights, strict=ctx.load_module_strict)
                except RuntimeError as exc:
                    raise CheckpointError(f"{ctx.tag_dir}/{name}: the saved weights do not fit layer {index}: "
                                          f"{exc}") from exc

        return apply

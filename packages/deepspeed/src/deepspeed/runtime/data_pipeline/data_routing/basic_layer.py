"""``RandomLayerTokenDrop``: run a transformer layer on a random subset of the tokens during training.

The first random-LTD layer (``random_ltd_layer_id == 0``) draws sorted random indices for every random-LTD
layer at once and keeps them (and the cut attention masks) in the scheduler's state; the others reuse them.
The layer sees only the kept tokens; its outputs are scattered back, dropped tokens pass through unchanged.
In eval mode, before ``init_config``, or when the sequence is not longer than the kept count, the wrapped
layer runs as is.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.nn import Module

from deepspeed.runtime.data_pipeline import constants as C
from deepspeed.runtime.data_pipeline.data_routing._token_ops import (
    bert_sample_tokens,
    gather_tokens,
    gpt_sample_tokens,
    scatter_tokens,
)

_SAMPLERS = {"encoder": bert_sample_tokens, "decoder": gpt_sample_tokens}
_ORDERS = {"batch_seq_dim": True, "seq_batch_dim": False}


class RandomLayerTokenDrop(Module):
    """A layer wrapper for random-LTD; configure it with ``init_config`` (the engine does, per random-LTD layer)."""

    def __init__(self, layer: Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler = None
        self.max_length: int | None = None
        self.reserved_length = -1
        self.curr_seq = -1
        self.curr_micro_batch = -1
        self.batch_first = False

    def init_config(self, config: Any, scheduler: Any, random_ltd_layer_id: int) -> None:
        """Attach the random-LTD ``config`` (dict or typed section), the shared ``RandomLTDScheduler`` and this
        layer's index among the random-LTD layers (0 draws the indices for all)."""
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import as_plain_dict

        config = as_plain_dict(config)
        hs_order, model_type = config.get(C.RANDOM_LTD_HIDDEN_STATE_ORDER), config.get(C.RANDOM_LTD_MODEL_TYPE)
        if hs_order not in _ORDERS:
            raise ValueError(f"random_ltd.{C.RANDOM_LTD_HIDDEN_STATE_ORDER}={hs_order!r}: accepted: "
                             f"{', '.join(_ORDERS)}")
        if model_type not in _SAMPLERS:
            raise ValueError(f"random_ltd.{C.RANDOM_LTD_MODEL_TYPE}={model_type!r}: accepted: {', '.join(_SAMPLERS)}")
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state[C.RANDOM_LTD_MAX_VALUE]
        self.mask_name = config.get(C.RANDOM_LTD_MODEL_MASK_NAME)
        self.micro_bs = config.get(C.RANDOM_LTD_MICRO_BATCH_SIZE)
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        self.batch_first = _ORDERS[hs_order]
        self.model_type = model_type
        self.index_generator = _SAMPLERS[model_type]

    def _read_shape(self, hidden_states: Tensor) -> None:
        seq_dim, batch_dim = (1, 0) if self.batch_first else (0, 1)
        self.curr_seq, self.curr_micro_batch = hidden_states.shape[seq_dim], hidden_states.shape[batch_dim]

    def _indices_and_mask(self, hidden_states: Tensor, mask: Tensor | None):
        state = self.random_ltd_scheduler.state
        if self.random_ltd_layer_id == 0:
            state[C.RANDOM_LTD_SAMPLE_INDEX], state[C.RANDOM_LTD_ATTENTION_MASK] = self.index_generator(
                self.reserved_length, self.curr_seq, self.curr_micro_batch, self.random_ltd_num_layer,
                hidden_states.device, mask)
        return state[C.RANDOM_LTD_SAMPLE_INDEX], state[C.RANDOM_LTD_ATTENTION_MASK]

    def forward(self, hidden_states: Tensor, **kwargs: Any) -> Any:
        if self.random_ltd_scheduler is not None:
            self.reserved_length = self.random_ltd_scheduler.get_current_seq()
            self._read_shape(hidden_states)
        if not (self.training and self.random_ltd_scheduler is not None and self.reserved_length < self.curr_seq):
            return self.random_ltd_layer(hidden_states, **kwargs)
        mask = kwargs[self.mask_name] if self.mask_name is not None else None
        indices, part_mask = self._indices_and_mask(hidden_states, mask)
        layer_indices = indices[self.random_ltd_layer_id]
        part_hidden = gather_tokens(hidden_states, layer_indices, self.batch_first)
        if self.mask_name is not None:
            kwargs[self.mask_name] = part_mask[self.random_ltd_layer_id] if self.model_type == "encoder" else part_mask
        outputs = self.random_ltd_layer(part_hidden, **kwargs)
        if isinstance(outputs, Tensor):
            return scatter_tokens(hidden_states, outputs, layer_indices, self.batch_first)
        if isinstance(outputs, tuple):
            merged = scatter_tokens(hidden_states, outputs[0], layer_indices, self.batch_first)
            return (merged, *outputs[1:])
        raise TypeError(f"random-LTD wraps layers returning a Tensor or a tuple, got {type(outputs).__name__}; "
                        "adapt the layer's output")

"""``ResidualAddOp``: the residual connection after a transformer layer's MLP, with the attention output and
biases, divided over the model-parallel ranks (each adds its share before the all-reduce).

``residual_add_func(hidden_state, residual, attention_output, attention_bias, final_bias, mp_size,
mlp_after_attn, add_bias, pre_layer_norm)`` writes the result into ``residual`` and returns it:

- MLP after attention, pre-LN: ``hidden + (residual + attention_output + attention_bias + final_bias) / mp_size``
- MLP after attention, post-LN: ``residual + hidden + final_bias``
- parallel attention and MLP (GPT-J): ``hidden + attention_output + (residual + final_bias) / mp_size``, plus
  ``attention_bias / mp_size`` when ``add_bias``; this form also accumulates into ``hidden_state``.
"""

from __future__ import annotations

import torch

from .base import BaseOp
from .vector_add import VectorAddOp


class ResidualAddOp(BaseOp):
    @staticmethod
    def residual_add_func(hidden_state: torch.Tensor, residual: torch.Tensor, attention_output: torch.Tensor,
                          attention_bias: torch.Tensor, final_bias: torch.Tensor, mp_size: int,
                          mlp_after_attn: bool, add_bias: bool, pre_layer_norm: bool) -> torch.Tensor:
        if mlp_after_attn:
            if pre_layer_norm:
                parts = residual.float() + attention_output.float() + attention_bias.float() + final_bias.float()
                out = parts / mp_size + hidden_state.float()
            else:
                out = residual.float() + hidden_state.float() + final_bias.float()
        else:
            hidden_state += attention_output + (residual + final_bias) / mp_size
            if add_bias:
                hidden_state += attention_bias / mp_size
            out = hidden_state
        residual.copy_(out.to(hidden_state.dtype))
        return residual

    def forward(self, hidden_state: torch.Tensor, residual: torch.Tensor, add_bias: bool,
                attention_output: torch.Tensor | None = None, residual_add: torch.Tensor | None = None,
                attention_bias: torch.Tensor | None = None, final_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Without biases: ``(residual + attention_output) / mp_size + hidden_state``. With them: the formulas
        above, where a post-LN layer's ``residual_add`` (when given) replaces ``residual``."""
        if final_bias is None and attention_bias is None:
            return VectorAddOp.vector_add_func(residual + attention_output, hidden_state, 1.0 / self.config.mp_size)
        if not self.config.pre_layer_norm and residual_add is not None:
            residual = residual_add
        return self.residual_add_func(hidden_state, residual, attention_output, attention_bias, final_bias,
                                      self.config.mp_size, self.config.mlp_after_attn, add_bias,
                                      self.config.pre_layer_norm)

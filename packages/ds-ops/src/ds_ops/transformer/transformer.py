"""``DeepSpeedTransformerLayer``: a BERT encoder layer (Pre-LN or Post-LN) in torch.

DeepSpeed's version runs fused CUDA kernels; this one is built from torch ops (SDPA for attention, which fuses
where torch has a fused kernel) plus the small autograd functions of ``_autograd`` that implement the memory
options. Parameters carry DeepSpeed's names and shapes, so state dicts move between the two:

- ``attn_qkvw [3H, H]``, ``attn_qkvb [3H]``: query, key and value projections stacked in that order,
- ``attn_ow [H, H]``, ``attn_ob``: attention output projection,
- ``attn_nw``, ``attn_nb``: the attention LayerNorm (Post-LN: after the attention residual; Pre-LN: before it),
- ``inter_w [I, H]``, ``inter_b``, ``output_w [H, I]``, ``output_b``: the feed-forward block (GeLU between),
- ``norm_w``, ``norm_b``: the feed-forward LayerNorm (Post-LN: after its residual; Pre-LN: before it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._autograd import dropout_attention, gelu_linear, invertible_layer_norm
from .config import DeepSpeedTransformerConfig

# DeepSpeed's names for the parameters in initial_weights / initial_biases order (after q, k, v)
_WEIGHTS = ("attn_ow", "attn_nw", "inter_w", "output_w", "norm_w")
_BIASES = ("attn_ob", "attn_nb", "inter_b", "output_b", "norm_b")
_GRAD_LABELS = {"attn_ow": "O_W", "attn_ob": "O_B", "attn_nw": "N2_W", "attn_nb": "N2_B", "inter_w": "int_W",
                "inter_b": "int_B", "output_w": "out_W", "output_b": "out_B", "norm_w": "norm_W", "norm_b": "norm_B"}
_UNSUPPORTED = ("head_mask", "layer_head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_value")


class DeepSpeedTransformerLayer(nn.Module):
    """One transformer encoder layer configured by a ``DeepSpeedTransformerConfig``.

    ``initial_weights`` / ``initial_biases``: optional sequences of 8 tensors (query, key, value, attention output,
    attention LayerNorm, intermediate, output, output LayerNorm) to start from instead of the random init; the
    attention-output-onwards entries are used as the layer's parameters (as in DeepSpeed), q/k/v are stacked.
    ``layer_id`` counts the layers built in this process, as DeepSpeed does (it offsets the dropout seed).
    """

    layer_id = 0

    def __init__(self, config: DeepSpeedTransformerConfig, initial_weights: Sequence[torch.Tensor] | None = None,
                 initial_biases: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__()
        if not isinstance(config, DeepSpeedTransformerConfig):
            raise TypeError(f"DeepSpeedTransformerLayer: config must be a DeepSpeedTransformerConfig, got "
                            f"{type(config).__name__}")
        config.validate()
        self.config = config
        self.layer_id = config.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        if config.local_rank >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(config.local_rank)  # on a CPU-only machine there is no device to select
        dtype = torch.float16 if config.fp16 else torch.get_default_dtype()
        hidden, inter = config.hidden_size, config.intermediate_size
        shapes = {"attn_qkvw": (3 * hidden, hidden), "attn_qkvb": (3 * hidden,), "attn_ow": (hidden, hidden),
                  "attn_ob": (hidden,), "attn_nw": (hidden,), "attn_nb": (hidden,), "inter_w": (inter, hidden),
                  "inter_b": (inter,), "output_w": (hidden, inter), "output_b": (hidden,), "norm_w": (hidden,),
                  "norm_b": (hidden,)}
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype)))
        if initial_weights is None and initial_biases is None:
            config.validate_init()
            self.init_transformer_weights(config.adjust_init_range)
        else:
            self._load_initial(initial_weights, initial_biases)
        self.train(config.training)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._grad_hooks: list[Any] = []

    # ---- weights -----------------------------------------------------------------------------------------
    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """BERT's init: normal(0, initializer_range) weights, zero biases, unit LayerNorms; with
        ``adjust_init_range`` the two output projections use std ``initializer_range / sqrt(2 * num_layers)``
        (they feed the residual stream, whose variance grows with depth)."""
        std = self.config.initializer_range
        output_std = std / math.sqrt(2.0 * self.config.num_hidden_layers) if adjust_init_range else std
        with torch.no_grad():
            for name in ("attn_qkvw", "inter_w"):
                getattr(self, name).normal_(0.0, std)
            for name in ("attn_ow", "output_w"):
                getattr(self, name).normal_(0.0, output_std)
            for name in ("attn_qkvb", *_BIASES):
                getattr(self, name).zero_()
            self.attn_nw.fill_(1.0)
            self.norm_w.fill_(1.0)

    def _load_initial(self, weights: Sequence[torch.Tensor] | None, biases: Sequence[torch.Tensor] | None) -> None:
        for kind, given in (("initial_weights", weights), ("initial_biases", biases)):
            if given is not None and len(given) != 8:
                raise ValueError(f"DeepSpeedTransformerLayer: {kind} must hold 8 tensors (q, k, v, attention "
                                 "output, attention LayerNorm, intermediate, output, output LayerNorm), got "
                                 f"{len(given)}")
        with torch.no_grad():
            if weights is None:
                self.config.validate_init()
                self.init_transformer_weights(self.config.adjust_init_range)
            else:
                self.attn_qkvw.copy_(torch.cat([w.detach() for w in weights[:3]]))
                for name, tensor in zip(_WEIGHTS, weights[3:], strict=True):
                    getattr(self, name).copy_(tensor.detach())
            if biases is None:
                for name in ("attn_qkvb", *_BIASES):
                    getattr(self, name).zero_()
            else:
                self.attn_qkvb.copy_(torch.cat([b.detach() for b in biases[:3]]))
                for name, tensor in zip(_BIASES, biases[3:], strict=True):
                    getattr(self, name).copy_(tensor.detach())

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                head_mask: Any = None, layer_head_mask: Any = None, encoder_hidden_states: Any = None,
                encoder_attention_mask: Any = None, past_key_value: Any = None, output_attentions: bool = False,
                grads: list | None = None) -> torch.Tensor | tuple[torch.Tensor]:
        """``hidden_states [batch, seq, hidden]``; ``attention_mask``: additive (Hugging Face's extended mask,
        ``[batch, 1, 1, seq]`` with large negatives at padding) or boolean (True = attend), broadcastable to
        ``[batch, heads, seq, seq]``. ``grads``: a list that receives ``[gradient, label]`` pairs of the
        parameters in backward (DeepSpeed's testing hook). Returns ``[batch, seq, hidden]`` (``(output,)`` with
        ``return_tuple``)."""
        given = dict(zip(_UNSUPPORTED, (head_mask, layer_head_mask, encoder_hidden_states, encoder_attention_mask,
                                        past_key_value), strict=True))
        for name, value in given.items():
            if value is not None:
                raise ValueError(f"DeepSpeedTransformerLayer.forward: {name} is not supported (a self-attention "
                                 "encoder layer without head masks, cross-attention or a KV cache); pass None")
        if output_attentions:
            raise ValueError("DeepSpeedTransformerLayer.forward: output_attentions=True is not supported (the "
                             "attention probabilities are not materialised); pass False")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(f"DeepSpeedTransformerLayer.forward: hidden_states must be [batch, seq, "
                             f"{self.config.hidden_size}], got {list(hidden_states.shape)}")
        self.config.training = self.training
        self.config.is_grad_enabled = torch.is_grad_enabled()
        if grads is not None:
            self._record_grads(grads)
        output = self._layer(hidden_states, _additive_mask(attention_mask, hidden_states.dtype))
        return (output,) if self.config.return_tuple else output

    def _layer(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        if cfg.pre_layer_norm:
            attended = x + self._hidden_dropout(self._attention(self._norm(x, self.attn_nw, self.attn_nb), mask))
            return attended + self._hidden_dropout(self._feed_forward(self._norm(attended, self.norm_w, self.norm_b)))
        attended = self._norm(x + self._hidden_dropout(self._attention(x, mask)), self.attn_nw, self.attn_nb)
        return self._norm(attended + self._hidden_dropout(self._feed_forward(attended)), self.norm_w, self.norm_b)

    def _attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        heads = self.config.heads
        qkv = F.linear(x, self.attn_qkvw, self.attn_qkvb).view(batch, seq, 3, heads, hidden // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, seq, head_dim]
        p = self.config.attn_dropout_ratio if self.training else 0.0
        if p > 0 and not self.config.stochastic_mode:  # masks from the layer's generator: reproducible
            keep = self._keep_mask((batch, heads, seq, seq), p, x.device)
            context = dropout_attention(q, k, v, mask, keep, p, not self.config.attn_dropout_checkpoint)
        else:  # torch's fused attention (flash / memory-efficient kernels keep no [seq, seq] tensor)
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        context = context.transpose(1, 2).reshape(batch, seq, hidden)
        return F.linear(context, self.attn_ow, self.attn_ob)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        intermediate = F.linear(x, self.inter_w, self.inter_b)
        if self.config.gelu_checkpoint and torch.is_grad_enabled():
            return gelu_linear(intermediate, self.output_w, self.output_b)
        return F.linear(F.gelu(intermediate), self.output_w, self.output_b)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self.config.normalize_invertible and torch.is_grad_enabled():
            return invertible_layer_norm(x, weight, bias, self.config.layer_norm_eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.config.layer_norm_eps)

    def _hidden_dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout_ratio if self.training else 0.0
        if p == 0:
            return x
        return x * self._keep_mask(x.shape, p, x.device) * (1.0 / (1.0 - p))  # keeps a 1-byte mask for backward

    def _keep_mask(self, shape: Sequence[int], p: float, device: torch.device) -> torch.Tensor:
        """Boolean keep-mask with probability ``1 - p``, drawn from the layer's seeded generator (``seed >= 0``)
        or torch's global one."""
        generator = None
        if self.config.seed >= 0:
            generator = self._generators.get(device)
            if generator is None:
                generator = torch.Generator(device=device).manual_seed(self.config.seed + self.layer_id)
                self._generators[device] = generator
        return torch.rand(tuple(shape), generator=generator, device=device) >= p

    def _record_grads(self, grads: list) -> None:
        for handle in self._grad_hooks:  # one set of hooks: the latest forward's list receives the gradients
            handle.remove()
        hooks = self._grad_hooks = []
        hidden = self.config.hidden_size
        for index, label in enumerate("QKV"):
            part = slice(index * hidden, (index + 1) * hidden)
            hooks.append(self.attn_qkvw.register_hook(
                lambda g, part=part, label=label: grads.append([g[part], f"{label}_W"])))
            hooks.append(self.attn_qkvb.register_hook(
                lambda g, part=part, label=label: grads.append([g[part], f"{label}_B"])))
        for name, label in _GRAD_LABELS.items():
            hooks.append(getattr(self, name).register_hook(lambda g, label=label: grads.append([g, label])))


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Boolean masks (True = attend) become additive ones, so both attention paths take the same input."""
    if mask is None or mask.dtype != torch.bool:
        return mask if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

"""``DeepSpeedTransformerConfig``: the options of the BERT-style transformer kernel layer.

Same constructor, attributes and defaults as DeepSpeed's (``-1`` means "not set"); the values are checked when a
``DeepSpeedTransformerLayer`` is built from the config, since DeepSpeed scripts create the config first and fill
fields (``from_dict``) afterwards.
"""

from __future__ import annotations

import json
import os
from typing import Any


class DeepSpeedTransformerConfig:
    """Options of one ``DeepSpeedTransformerLayer``.

    ``batch_size`` (the largest batch the layer sees; informational here, torch sizes buffers per call),
    ``hidden_size``, ``intermediate_size`` (``<= 0``: 4 x hidden), ``heads``, ``attn_dropout_ratio`` (dropout on the
    attention probabilities), ``hidden_dropout_ratio`` (dropout on the attention and feed-forward outputs),
    ``num_hidden_layers`` and ``initializer_range`` (weight init; ``adjust_init_range`` scales the two output
    projections by ``1/sqrt(2 * num_hidden_layers)``), ``layer_norm_eps``, ``local_rank`` (CUDA device to use, ``-1``:
    the current one), ``seed`` (dropout seed, ``-1``: torch's global generator), ``fp16`` (half-precision weights and
    compute), ``pre_layer_norm`` (Pre-LN instead of BERT's Post-LN).

    Memory options (same results, fewer saved activations): ``normalize_invertible`` (LayerNorm backward from its
    output, dropping its input), ``gelu_checkpoint`` (recompute the GeLU output in backward),
    ``attn_dropout_checkpoint`` (recompute the dropped-out attention probabilities in backward).

    ``stochastic_mode``: use torch's fused attention dropout (faster, masks drawn from torch's global generator, so
    not reproducible against the default mode); ``return_tuple``: ``forward`` returns ``(output,)``; ``training``:
    the layer's initial train/eval mode.
    """

    def __init__(self, batch_size: int = -1, hidden_size: int = -1, intermediate_size: int = -1, heads: int = -1,
                 attn_dropout_ratio: float = -1, hidden_dropout_ratio: float = -1, num_hidden_layers: int = -1,
                 initializer_range: float = -1, layer_norm_eps: float = 1e-12, local_rank: int = -1, seed: int = -1,
                 fp16: bool = False, pre_layer_norm: bool = True, normalize_invertible: bool = False,
                 gelu_checkpoint: bool = False, adjust_init_range: bool = True, attn_dropout_checkpoint: bool = False,
                 stochastic_mode: bool = False, return_tuple: bool = False, training: bool = True) -> None:
        self.layer_id = -1  # set by the layer built from this config (DeepSpeed numbers layers in build order)
        self.batch_size = batch_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size if intermediate_size > 0 else 4 * hidden_size
        self.heads = heads
        self.attn_dropout_ratio = attn_dropout_ratio
        self.hidden_dropout_ratio = hidden_dropout_ratio
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
        self.local_rank = local_rank
        self.seed = seed
        self.fp16 = fp16
        self.pre_layer_norm = pre_layer_norm
        self.normalize_invertible = normalize_invertible
        self.gelu_checkpoint = gelu_checkpoint
        self.adjust_init_range = adjust_init_range
        self.attn_dropout_checkpoint = attn_dropout_checkpoint
        self.stochastic_mode = stochastic_mode
        self.return_tuple = return_tuple
        self.training = training
        self.is_grad_enabled = True
        self.test_gemm = False  # DeepSpeed's GEMM-algorithm search switch; torch picks its own GEMMs

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> DeepSpeedTransformerConfig:
        """A config whose attributes are set from ``json_object`` (unknown keys are an error)."""
        config = cls()
        for key, value in json_object.items():
            if key not in config.__dict__:
                raise ValueError(f"DeepSpeedTransformerConfig.from_dict: unknown key {key!r}; accepted: "
                                 f"{sorted(config.__dict__)}")
            setattr(config, key, value)
        return config

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> DeepSpeedTransformerConfig:
        """Read a JSON file (UTF-16, as DeepSpeed writes them, or UTF-8)."""
        with open(json_file, "rb") as reader:
            raw = reader.read()
        text = raw.decode("utf-16") if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else raw.decode("utf-8")
        return cls.from_dict(json.loads(text))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"DeepSpeedTransformerConfig({self.__dict__})"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first option a layer cannot be built with."""
        for name in ("hidden_size", "intermediate_size", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DeepSpeedTransformerConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.heads:
            raise ValueError(f"DeepSpeedTransformerConfig: hidden_size ({self.hidden_size}) must be divisible by "
                             f"heads ({self.heads})")
        for name in ("attn_dropout_ratio", "hidden_dropout_ratio"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"DeepSpeedTransformerConfig.{name} must be in [0, 1), got {value!r}")

    def validate_init(self) -> None:
        """Raise ``ValueError`` when the weight initialisation options are unusable."""
        if not isinstance(self.initializer_range, (int, float)) or self.initializer_range <= 0:
            raise ValueError("DeepSpeedTransformerConfig.initializer_range must be positive (std of the weight "
                             f"init), got {self.initializer_range!r}")
        if self.adjust_init_range and (not isinstance(self.num_hidden_layers, int) or self.num_hidden_layers <= 0):
            raise ValueError("DeepSpeedTransformerConfig.num_hidden_layers must be a positive int when "
                             "adjust_init_range is True (it scales the output projections' init), got "
                             f"{self.num_hidden_layers!r}")

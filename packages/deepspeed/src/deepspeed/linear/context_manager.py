"""``deepspeed.linear.Init`` (build a model's linears as LoRA layers, each rank creating only its base-weight
shard) and ``init_lora`` (freeze the model, create the adapters)."""

from __future__ import annotations

import warnings

import torch

from deepspeed.linear.config import LoRAConfig, QuantizationConfig
from deepspeed.linear.optimized_linear import LoRAOptimizedLinear, OptimizedLinear


def init_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Freeze every parameter of ``model``, then create the adapters of its LoRA layers (the trainable part)."""
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, LoRAOptimizedLinear):
            module.init_lora()
    return model


def _transformers_auto_cls():
    try:
        import transformers
    except ImportError:
        return None
    return transformers.AutoModelForCausalLM


class Init:
    """``with deepspeed.linear.Init(lora_config=..., quant_config=...):`` every ``torch.nn.Linear(in, out, ...)``
    built inside becomes ``OptimizedLinear(in, out, ..., lora_config, quant_config)`` with delayed adapters
    (``bias`` defaults to False there). ``transformers.AutoModelForCausalLM.from_pretrained``/``from_config``
    called inside also run :func:`init_lora` on the model they return; any other model needs ``init_lora(model)``
    after construction (a warning at exit says so when nothing called it).
    """

    def __init__(self, lora_config: LoRAConfig | None = None, quant_config: QuantizationConfig | None = None):
        self.lora_config = lora_config
        self.quant_config = quant_config
        self._orig_linear = torch.nn.Linear
        self._auto_cls = _transformers_auto_cls()
        self._orig_auto = {}
        self._post_init_complete = False

    def _make_linear_factory(self):
        lora_config, quant_config, linear_cls = self.lora_config, self.quant_config, self._orig_linear

        class OptimizedLinearFactory:
            """Stands in for torch.nn.Linear inside the context: calling it builds an OptimizedLinear."""

            def __new__(cls, *args, **kwargs):
                if lora_config is not None:
                    lora_config.delay_lora_init = True
                kwargs.update(lora_config=lora_config, quantization_config=quant_config, linear_cls=linear_cls)
                return OptimizedLinear(*args, **kwargs)

        return OptimizedLinearFactory

    def _wrap_auto(self, name: str):
        original = self._orig_auto[name]

        def build(*args, **kwargs):
            model = original(*args, **kwargs)
            if self.lora_config is not None:
                init_lora(model)
            self._post_init_complete = True
            return model

        return build

    def __enter__(self) -> Init:
        torch.nn.Linear = self._make_linear_factory()
        if self._auto_cls is not None:
            for name in ("from_pretrained", "from_config"):
                self._orig_auto[name] = getattr(self._auto_cls, name)
                setattr(self._auto_cls, name, self._wrap_auto(name))
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.Linear = self._orig_linear
        for name, original in self._orig_auto.items():
            setattr(self._auto_cls, name, original)
        self._orig_auto.clear()
        if not self._post_init_complete and exc[0] is None:
            warnings.warn("deepspeed.linear.Init: the LoRA adapters are created by transformers' "
                          "AutoModelForCausalLM.from_pretrained/from_config only; call "
                          "deepspeed.linear.init_lora(model) on a model built another way before training",
                          stacklevel=2)

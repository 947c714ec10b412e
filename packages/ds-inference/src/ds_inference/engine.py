"""``InferenceEngine``: the module ``init_inference`` returns (DeepSpeed's ``deepspeed.inference.engine``).

Set-up order: check the options this build runs on the plain torch path, create the expert-parallel groups of
DeepSpeed MoE layers (``moe`` section), materialise empty (meta) parameters, load a checkpoint (full tensors,
re-assembled from any tensor-parallel size; experts by their global index), shard with AutoTP, save the
re-sharded checkpoint if asked, convert the dtype (int8: weight-only quantization of Linear and embedding
weights), move to the accelerator. ``forward`` runs the module (replaying a CUDA graph when asked on a GPU);
``generate`` is the wrapped model's own ``generate`` with beam search refused (as DeepSpeed) and the
``max_tokens`` budget checked first.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ds_config.inference import DeepSpeedInferenceConfig
from ds_inference._config import InferenceConfig, build_config
from ds_inference._cuda_graph import CudaGraphRunner
from ds_inference._moe import expert_checkpoint_keys, setup_expert_parallel
from ds_inference._tp import shard_model, tensor_parallel_group
from ds_inference.checkpoint import describe_checkpoint, read_full_state_dict, save_tp_checkpoint
from ds_inference.quantization import quantize_weights

__all__ = ["BeamSearchError", "InferenceEngine", "TokenLimitError"]

_WARNED: set[str] = set()


class TokenLimitError(ValueError, RuntimeError):
    """``generate`` was asked for more tokens (input + new) than ``max_tokens`` allows.

    A ``RuntimeError`` as well, which is what DeepSpeed raises for this."""


class BeamSearchError(NotImplementedError, ValueError):
    """``generate`` was asked for beam search (``num_beams > 1``), which DeepSpeed inference refuses.

    A ``NotImplementedError``, as DeepSpeed raises, and a ``ValueError`` (a bad argument value)."""


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=4)


def _plain_path_notices(config: DeepSpeedInferenceConfig, tensor_parallel: bool) -> bool:
    """Warn (once per process) about options that run the plain torch path here; whether CUDA graphs are used."""
    if config.replace_with_kernel_inject:
        _warn_once("kernel_inject", "replace_with_kernel_inject (kernel_inject) is set, but this DeepSpeed build has "
                   "no fused inference kernels: the model runs its own torch layers (same outputs)")
    if config.use_triton or config.triton_autotune:
        _warn_once("use_triton", "use_triton/triton_autotune is set, but this DeepSpeed build has no triton "
                   "inference kernels: the model runs its own torch layers")
    if not config.enable_cuda_graph:
        return False
    if not torch.cuda.is_available():
        _warn_once("cuda_graph", "enable_cuda_graph is set but CUDA is not available: forward runs eagerly")
        return False
    if tensor_parallel:
        raise ValueError("enable_cuda_graph=True is not supported with tensor parallelism (tp_size > 1), as in "
                         "DeepSpeed; turn one of them off")
    return True


def _check_meta_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary ``inv_freq``, ...) are in no checkpoint: made on the meta device, they
    would hold garbage after ``to_empty``, so refuse instead of giving silently wrong outputs."""
    lost = sorted(f"{prefix}.{name}" if prefix else name
                  for prefix, module in model.named_modules() for name in module._non_persistent_buffers_set
                  if module._buffers.get(name) is not None and module._buffers[name].is_meta)
    if lost:
        raise ValueError(f"set_empty_params / meta model: the non-persistent buffers {lost[:4]} are in no checkpoint "
                         "and were created on the meta device; build these modules on the CPU (e.g. create the "
                         "model under torch.device('meta') except its rotary embedding) before init_inference")


def _materialize_meta(model: nn.Module) -> None:
    """Give every meta parameter and buffer uninitialised CPU storage (the checkpoint fills it), keeping tied
    parameters tied; unlike ``to_empty`` this leaves tensors that are already real (a rotary table) alone."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                if id(param) not in done:
                    done[id(param)] = nn.Parameter(torch.empty_like(param, device="cpu"), param.requires_grad)
                module._parameters[name] = done[id(param)]
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device="cpu")


class InferenceEngine(nn.Module):
    """Wraps a model for inference; ``engine.module`` is the (converted, possibly sharded) model."""

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig | dict[str, Any] | None) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        config = InferenceConfig.of(config) if isinstance(config, DeepSpeedInferenceConfig) else build_config(config)
        if config.replace_with_kernel_inject and config.injection_policy:
            raise ValueError("injection_policy and replace_with_kernel_inject (kernel_inject) exclude each other: "
                             "give one of them")
        self._config = config
        self.mp_group = tensor_parallel_group(config.tensor_parallel)
        use_graph = _plain_path_notices(config, self.mp_group is not None)
        self.module = model
        self._experts = setup_expert_parallel(model, config, self.mp_group is not None)
        # as DeepSpeed: the model's own (HF) config, or the inference config's ``config``/``args`` dict;
        # pipelines read ``engine.config`` when the engine replaces their model
        self.config = config.config if config.config is not None else getattr(model, "config", None)
        self._load_checkpoint()
        if self.mp_group is not None:
            self.module = shard_model(self.module, config, self.mp_group)
        self._save_checkpoint()
        self.quantized_modules = self._convert_dtype()
        if torch.cuda.is_available() and not config.keep_module_on_host:
            self.module.to(torch.device("cuda", torch.cuda.current_device()))
        self._graph = CudaGraphRunner(self.module) if use_graph else None
        if hasattr(model, "generate"):  # as DeepSpeed: only a model with generate() gets one
            self.generate = self._generate

    # -- set-up steps ----------------------------------------------------------------------------------------
    def _checkpoint_source(self) -> Any:
        cfg = self._config
        return cfg.checkpoint if cfg.checkpoint is not None else cfg.checkpoint_config.checkpoint_dir

    def _load_checkpoint(self) -> None:
        cfg = self._config
        source = self._checkpoint_source()
        on_meta = any(t.is_meta for t in (*self.module.parameters(), *self.module.buffers()))
        if (on_meta or cfg.set_empty_params) and source is None:
            raise ValueError("the model has empty (meta) parameters (set_empty_params) but no 'checkpoint' "
                             "was given to fill them")
        if on_meta:
            _check_meta_buffers(self.module)
            _materialize_meta(self.module)
        if source is None:
            return
        desc = describe_checkpoint(source, cfg.base_dir or cfg.checkpoint_config.base_dir or "",
                                   cfg.training_mp_size)
        aliases, known = expert_checkpoint_keys(self._experts, list(self.module.state_dict()))
        state = read_full_state_dict(desc, self.module, aliases, known)
        self.module.load_state_dict(state, strict=True)

    def _save_checkpoint(self) -> None:
        path = self._config.save_mp_checkpoint_path or self._config.checkpoint_config.save_mp_checkpoint_path
        if path is None:
            return
        plan: dict[str, int | None] = {}
        if self.mp_group is not None:
            from ds_inference.autotp import tp_plan

            plan = tp_plan(self.module)
        save_tp_checkpoint(self.module, path, self.mp_group, plan)

    def _convert_dtype(self) -> list[str]:
        cfg = self._config
        if cfg.dtype == torch.int8:
            weight = cfg.quant.weight
            off = [key for key, on in (("quant.enabled", cfg.quant.enabled), ("quant.weight.enabled", weight.enabled))
                   if not on]
            if off:
                raise ValueError(f"dtype=int8 is weight-only int8 quantization, but {' and '.join(off)} = False; "
                                 "set it to True or pick a float dtype (fp16, bf16, fp32)")
            return quantize_weights(self.module, weight.num_bits, weight.q_groups, weight.q_type)
        self.module.to(cfg.dtype)
        return []

    # -- running ---------------------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (through its captured CUDA graph when ``enable_cuda_graph`` is on a GPU)."""
        if self._graph is not None:
            return self._graph(*inputs, **kwargs)
        return self.module(*inputs, **kwargs)

    def _token_budget(self, inputs: tuple, kwargs: dict[str, Any]) -> None:
        # HF generate takes the prompt as its first argument, ``inputs=`` or ``input_ids=``
        ids = kwargs.get("input_ids", kwargs.get("inputs", inputs[0] if inputs else None))
        if not isinstance(ids, torch.Tensor):
            return
        prompt = ids.shape[-1]
        gen = kwargs.get("generation_config") or getattr(self.module, "generation_config", None)
        new = kwargs.get("max_new_tokens", getattr(gen, "max_new_tokens", None))
        if new is None:
            longest = kwargs.get("max_length", getattr(gen, "max_length", None))
            new = max(0, longest - prompt) if longest is not None else 0
        limit, least = self._config.max_out_tokens, self._config.min_out_tokens
        if prompt + new > limit or prompt + least > limit:
            raise TokenLimitError(
                f"generate would handle {prompt} input + {max(new, least)} new tokens = {prompt + max(new, least)}, "
                f"more than max_tokens (max_out_tokens) = {limit}; raise max_tokens in the inference config or "
                "ask for fewer tokens")

    @staticmethod
    def _greedy_or_sampling(kwargs: dict[str, Any]) -> None:
        # as DeepSpeed: num_beams from a generation_config argument, overridden by a num_beams argument
        beams, source = 1, None
        if "generation_config" in kwargs:
            beams, source = getattr(kwargs["generation_config"], "num_beams", 1), "generation_config.num_beams"
        if "num_beams" in kwargs:
            beams, source = kwargs["num_beams"], "num_beams"
        if beams is not None and beams > 1:
            raise BeamSearchError(f"generate: {source}={beams} asks for beam search, which DeepSpeed inference does "
                                  "not support; accepted: num_beams=1 (greedy decoding or sampling)")

    def _generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate``, after refusing beam search and checking the ``max_tokens`` budget."""
        self._greedy_or_sampling(kwargs)
        self._token_budget(inputs, kwargs)
        if hasattr(self.module, "reset_cache"):
            self.module.reset_cache()
        return self.module.generate(*inputs, **kwargs)

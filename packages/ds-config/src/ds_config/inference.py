"""``DeepSpeedInferenceConfig``: everything ``deepspeed.init_inference()`` accepts, typed.

Serves ``deepspeed.inference.config``. ``dtype`` is stored as ``DtypeEnum`` (a string enum) so that this
package never imports torch; ``ds_inference`` maps it with ``getattr(torch, cfg.dtype.torch_name)``.
Process groups and model-parallel units are opaque objects here (``Any``). Deprecated keys (mp_size, mpu,
ep_size, ep_group, ep_mp_group, moe_experts, moe_type) move into ``tensor_parallel``/``moe`` with a warning
and are left out of dumps.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ds_config._base import Deprecated
from ds_config._inference_parts import (
    ActivationQuantConfig,
    DeepSpeedMoEConfig,
    DeepSpeedTPConfig,
    DtypeEnum,
    InferenceCheckpointConfig,
    MoETypeEnum,
    QKVQuantConfig,
    QuantizationConfig,
    WeightQuantConfig,
)
from ds_config._typed_section import Bool, NonNegInt, PosInt, SectionModel, deprecated_field
from ds_config.zero import DeepSpeedZeroConfig

__all__ = [
    "ActivationQuantConfig",
    "DeepSpeedInferenceConfig",
    "DeepSpeedMoEConfig",
    "DeepSpeedTPConfig",
    "DtypeEnum",
    "InferenceCheckpointConfig",
    "MoETypeEnum",
    "QKVQuantConfig",
    "QuantizationConfig",
    "WeightQuantConfig",
]


class DeepSpeedInferenceConfig(SectionModel):
    """Sets parameters for DeepSpeed Inference Engine."""

    replace_with_kernel_inject: Bool = Field(False, alias="kernel_inject")
    """Inject DeepSpeed inference kernels (BERT, GPT-2, GPT-Neo, GPT-J...)."""

    dtype: DtypeEnum = DtypeEnum.fp16
    """Model data type: fp16/float16/half, fp32/float32/float, bf16/bfloat16, int8, or a torch.dtype."""

    tensor_parallel: DeepSpeedTPConfig = Field(default_factory=DeepSpeedTPConfig, alias="tp")
    """Tensor parallelism used to split the model across GPUs."""

    enable_cuda_graph: Bool = False
    """Capture the inference ops in a CUDA graph and replay it."""

    use_triton: Bool = False
    """Use triton kernels for inference ops."""

    triton_autotune: Bool = False
    """Autotune triton kernels (faster steady state, slower first run)."""

    zero: DeepSpeedZeroConfig = Field(default_factory=DeepSpeedZeroConfig)
    """ZeRO configuration used with the inference engine (ZeRO-Inference)."""

    triangular_masking: Bool = Field(True, alias="tm")
    """Use causal (triangular) masking of attention scores."""

    moe: DeepSpeedMoEConfig = Field(default_factory=DeepSpeedMoEConfig)
    """MoE settings; ``true``/``false`` are accepted and set ``moe.enabled``."""

    keep_module_on_host: Bool = False
    """Keep checkpoint tensors on host while loading instead of moving them to the device."""

    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    """MoQ quantization settings (only used with the int8 dtype)."""

    checkpoint: str | dict[str, Any] | None = None
    """Path to a DeepSpeed-compatible checkpoint, or to a JSON load policy, or that policy as a dict."""

    base_dir: str = ""
    """Root directory of the checkpoint files."""

    set_empty_params: Bool = False
    """Create the inference module with empty (not real) tensors."""

    save_mp_checkpoint_path: str | None = None
    """Save the loaded model re-sharded for the new parallelism degree to this path."""

    checkpoint_config: InferenceCheckpointConfig = Field(default_factory=InferenceCheckpointConfig,
                                                         alias="ckpt_config")
    """Checkpoint directories."""

    return_tuple: Bool = True
    """Transformer layers return a tuple (else a tensor)."""

    training_mp_size: PosInt = 1
    """Model-parallel size the loaded checkpoint was trained with."""

    replace_method: Annotated[str, Deprecated(note="It is no longer needed; remove it from the call")] = "auto"
    """Deprecated and unused (DeepSpeed picks the injection method itself); a value other than 'auto' warns."""

    injection_policy: dict[Any, Any] | None = Field(None, alias="injection_dict")
    """Maps a client ``nn.Module`` class to its injection policy."""

    injection_policy_tuple: tuple | None = None

    config: dict[str, Any] | None = Field(None, alias="args")

    max_out_tokens: PosInt = Field(1024, alias="max_tokens")
    """Maximum tokens (input + output) the engine works with."""

    min_out_tokens: NonNegInt = Field(1, alias="min_tokens")
    """Minimum tokens the caller expects to generate; the runtime errors early if it cannot provide them."""

    transposed_mode: Bool = False

    mp_size: Annotated[PosInt, Deprecated(new="tensor_parallel.tp_size")] = deprecated_field(1)
    """Deprecated, please use ``tensor_parallel.tp_size``."""

    mpu: Annotated[Any, Deprecated(new="tensor_parallel.mpu")] = deprecated_field()
    """Deprecated, please use ``tensor_parallel.mpu``."""

    ep_size: Annotated[PosInt, Deprecated(new="moe.ep_size")] = deprecated_field(1)
    """Deprecated, please use ``moe.ep_size``."""

    ep_group: Annotated[Any, Deprecated(new="moe.ep_group")] = deprecated_field(alias="expert_group")
    """Deprecated, please use ``moe.ep_group``."""

    ep_mp_group: Annotated[Any, Deprecated(new="moe.ep_mp_group")] = deprecated_field(alias="expert_mp_group")
    """Deprecated, please use ``moe.ep_mp_group``."""

    moe_experts: Annotated[list[PosInt], Deprecated(new="moe.moe_experts")] = deprecated_field([1])
    """Deprecated, please use ``moe.moe_experts``."""

    moe_type: Annotated[MoETypeEnum, Deprecated(new="moe.type")] = deprecated_field(MoETypeEnum.standard)
    """Deprecated, please use ``moe.type``."""

    @model_validator(mode="before")
    @classmethod
    def _moe_flag(cls, data: Any) -> Any:
        # "moe": true/false predates the MoE sub-config; make it a dict before deprecated keys move into it
        if isinstance(data, dict) and isinstance(data.get("moe"), bool):
            data = {**data, "moe": {"enabled": data["moe"]}}
        return data

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> DtypeEnum:
        return DtypeEnum.parse(value)

    @field_validator("min_out_tokens")
    @classmethod
    def _token_range(cls, value: int, info: ValidationInfo) -> int:
        most = info.data.get("max_out_tokens")
        if most is not None and value > most:
            raise ValueError(f"must not exceed max_out_tokens ({most})")
        return value

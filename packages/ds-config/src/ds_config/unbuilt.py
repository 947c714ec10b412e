"""Keys DeepSpeed's own config parser reads whose features are not built here.

A DeepSpeed config is accepted as DeepSpeed accepts it: a key DeepSpeed 0.19 reads is never an "unknown key".
Where the feature behind a key is not built, the key is still validated (its type, as DeepSpeed's parser
reads it) and, when its value would change what DeepSpeed does, ``InertConfigKeyWarning`` names it and says
why it has no effect (``INERT_KEYS``). docs/deviations.md lists the same keys.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from ds_config._base import DSConfigModel
from ds_config._types import Bool, Int, PosInt


class InertConfigKeyWarning(UserWarning):
    """A config key DeepSpeed reads was given, but the feature behind it is not built here: it has no effect."""


class HybridEngineConfig(DSConfigModel):
    """``hybrid_engine``: DeepSpeed-Chat's train/generate engine (``deepspeed.runtime.hybrid_engine``); its
    inference-kernel settings are validated only (the module's own layers generate)."""

    enabled: Bool = False
    max_out_tokens: Int = 512
    inference_tp_size: Int = 1
    release_inference_cache: Bool = False
    pin_parameters: Bool = True
    tp_gather_partition_size: Int = 8
    enable_cuda_graph: Bool = False


class NebulaConfig(DSConfigModel):
    """``nebula``: Azure Nebula checkpoint service (not built; validated only)."""

    enabled: Bool = False
    persistent_storage_path: str | None = None
    persistent_time_interval: PosInt = 100
    num_of_version_in_retention: PosInt = 2
    enable_nebula_load: Bool = True
    nebula_load_path: str | None = None


class ThroughputTimerConfig(DSConfigModel):
    """``timers.throughput``: DeepSpeed's samples/s timer."""

    enabled: Bool = True
    synchronized: Bool = True
    """Synchronise the device around each measurement."""


class TimersConfig(DSConfigModel):
    """``timers``: engine timers."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


@dataclass(frozen=True)
class InertKey:
    """A key that is read and validated but not acted on: ``quiet(value)`` is true for values DeepSpeed would
    not act on either (so no warning)."""

    path: str
    quiet: Callable[[Any], bool]
    why: str


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


def _disabled(v: Any) -> bool:
    return isinstance(v, dict) and v.get("enabled", False) is False


def _timer_off(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("throughput"), dict) and v["throughput"].get("enabled") is False


INERT_KEYS: tuple[InertKey, ...] = (
    InertKey("hybrid_engine.inference_tp_size", _is(1), "the hybrid engine generates with the module's own layers "
             "on its training ranks; tensor-parallel generation with inference kernels is not built"),
    InertKey("hybrid_engine.enable_cuda_graph", _is(False), "the hybrid engine's CUDA-graph capture of inference "
             "kernels is not built"),
    InertKey("nebula", _disabled, "the Azure Nebula checkpoint service is not built (DeepSpeed 0.19.8 removed it)"),
    InertKey("datastates_ckpt", _is(None, False), "DataStates-LLM asynchronous checkpointing is not built"),
    InertKey("weight_quantization", _is(None), "quantizing weights at initialisation for training "
             "(quantized_initialization / post_init_quant) is not built; ds_inference has its own quantization"),
    InertKey("graph_harvesting", _is(False), "CUDA-graph capture of fused optimizer kernels is not built "
             "(DeepSpeed 0.19.8 removed it)"),
    InertKey("disable_python_gc", _is(False), "the engine leaves Python's garbage collector alone"),
    InertKey("data_types.keep_in_fp32_modules", _is(None, "auto"), "the named modules' parameters are cast "
             "with the rest (buffers keep their loaded dtype everywhere)"),
    InertKey("zero_optimization.compute_grad_norm", _is(True), "ZeRO stage 1/2 always computes the gradient "
             "norm"),
    InertKey("zero_optimization.parameter_alignment", _is(False), "ZeRO stage 1/2 flat buffers are not padded "
             "per parameter"),
    InertKey("quantize_training", _is(None), "DeepSpeed 0.19.6 reads only its eigenvalue settings (for MoQ, "
             "which it has disabled itself; 0.19.8 removed MoQ)"),
    InertKey("compression_training.shared_parameters", _is(None), "DeepSpeed 0.19 reads it only as the gate "
             "of quantize_training's eigenvalue settings"),
    InertKey("timers", _timer_off, "the engine's samples/s throughput timer is not built"),
    InertKey("autotuning.min_train_batch_size", _is(1), "DeepSpeed 0.19 reads it but its autotuner never "
             "uses it either"),
    InertKey("compile.free_activation_threshold", _is(10 * 1024 * 1024), "DeepCompile's free-activation pass "
             "is not built"),
    InertKey("compile.offload_activation_pin_memory", _is(True), "DeepCompile's activation offload is not built"),
    InertKey("checkpoint.checkpoint_serialization", _is(True), "checkpoints are always written in torch's "
             "zipfile format"),
    InertKey("checkpoint.writer", _is(None), "DeepSpeed's fast/decoupled checkpoint writers are not built; "
             "checkpoints are written by torch.save (atomically)"),
    InertKey("tensor_parallel.injection_policy_tuple", _is(None), "kernel-injection policies are an "
             "inference feature; AutoTP training shards by preset or partition_config"),
    InertKey("tensor_parallel.tp.mpu", _is(None), "AutoTP training takes its groups from deepspeed.initialize's "
             "mpu argument"),
    InertKey("tensor_parallel.tp.tp_group", _is(None), "AutoTP training takes its groups from "
             "deepspeed.initialize's mpu argument"),
    # the other expert_parallel keys act (ds_moe.autoep); disable_triton_grouped_mm asks for what runs anyway
)


def _lookup(data: dict[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def warn_inert_keys(data: dict[str, Any]) -> None:
    """``InertConfigKeyWarning`` for each given key of ``INERT_KEYS`` whose value DeepSpeed would act on."""
    for key in INERT_KEYS:
        given, value = _lookup(data, key.path)
        if given and value != "auto" and not key.quiet(value):
            warnings.warn(f"config key '{key.path}' is read by DeepSpeed but has no effect here: {key.why} "
                          "(see docs/deviations.md)", InertConfigKeyWarning, stacklevel=3)

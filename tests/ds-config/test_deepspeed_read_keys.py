"""Keys DeepSpeed 0.19's own config parser reads are accepted (issue 26): none of them is an "unknown key".

The list below was derived by running DeepSpeed's ``DeepSpeedConfig`` (0.19.6 source and 0.19.8 from PyPI) on
configs whose every dict recorded the keys read from it, and keeping those our schema rejected at the time.
Keys whose feature is not built warn (``InertConfigKeyWarning``) when their value would change what DeepSpeed
does; docs/deviations.md lists them.
"""

from __future__ import annotations

import warnings

import pytest

from ds_config import INERT_KEYS, ConfigError, InertConfigKeyWarning, load_config

BASE = {"train_batch_size": 4}

# (path, a value DeepSpeed accepts there)
READ_BY_DEEPSPEED = [
    ("dataloader_drop_last", True),
    ("gradient_allreduce_op", "sum"),
    ("graph_harvesting", True),
    ("log_level", "warning"),
    ("managed_gradient_accumulation", False),
    ("quantize_training", {"enabled": False}),
    ("use_data_before_expert_parallelism", True),
    ("vocabulary_size", 50304),
    ("data_parallel_size", 1),
    ("disable_python_gc", True),
    ("datastates_ckpt", {"host_cache_size": 16}),
    ("hybrid_engine", {"enabled": True, "max_out_tokens": 256, "inference_tp_size": 1,
                       "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8,
                       "enable_cuda_graph": False}),
    ("nebula", {"enabled": True, "persistent_storage_path": "/tmp/n", "persistent_time_interval": 10,
                "num_of_version_in_retention": 2, "enable_nebula_load": True, "nebula_load_path": None}),
    ("timers", {"throughput": {"enabled": True, "synchronized": False}}),
    ("weight_quantization", {"quantized_initialization": {"num_bits": 4}, "post_init_quant": {}}),
    ("pipeline", {"use_reentrant": False}),
    ("data_types", {"param_dtype": "fp32", "buffer_dtype": "fp32", "keep_in_fp32_modules": ["norm"]}),
    ("checkpoint", {"checkpoint_serialization": False,
                    "writer": {"type": "fast", "io_buffer_size": 1024, "io_buffer_double": False,
                               "show_statistics": True, "data_parallel": "socket", "decoupled": True,
                               "io_multiplier": 2}}),
    ("compile", {"free_activation_threshold": 4096, "offload_activation_pin_memory": False}),
    ("autotuning", {"min_train_batch_size": 2}),
    ("compression_training", {"shared_parameters": {"enabled": False}}),
    ("tensor_parallel", {"injection_policy_tuple": None, "tp": {"mpu": None, "tp_group": None}}),
    ("expert_parallel", {"expert_tensor_parallel_size": 1, "validate_folding_routing": True,
                         "moe_layer_pattern": "layers\\.\\d+\\.mlp", "expert_pattern": "experts",
                         "router_pattern": "gate", "use_grouped_mm": False, "disable_triton_grouped_mm": True,
                         "route_norm": True, "route_scale": 2.0, "score_apply": "pre", "combine_impl": "loop",
                         "num_expert_groups": 2, "num_limited_groups": 1, "score_func": "softmax", "top_k": 2,
                         "routed_scaling_factor": 1.5, "expert_w1": "w1", "expert_w2": "w2", "expert_w3": None,
                         "num_experts_attr": "num_experts", "top_k_attr": "top_k", "has_shared_experts": False,
                         "shared_experts_pattern": "shared", "shared_experts_gate_pattern": "shared_gate"}),
    ("zero_optimization", {"stage": 2, "compute_grad_norm": False, "parameter_alignment": True}),
]


@pytest.mark.parametrize(("key", "value"), READ_BY_DEEPSPEED, ids=[k for k, _ in READ_BY_DEEPSPEED])
def test_key_deepspeed_reads_is_accepted(key, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inert keys warn; that is tested below
        load_config({**BASE, key: value})


def _warnings_of(config: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({**BASE, **config})
    return [str(w.message) for w in caught if issubclass(w.category, InertConfigKeyWarning)]


def _nested(path: str, value: object) -> dict:
    *parents, leaf = path.split(".")
    node: dict = {leaf: value}
    for part in reversed(parents):
        node = {part: node}
    return node


# a value DeepSpeed acts on, for each inert key
ACTIVE = {"hybrid_engine.inference_tp_size": 2, "hybrid_engine.enable_cuda_graph": True, "nebula": {"enabled": True},
          "datastates_ckpt": {},
          "weight_quantization": {}, "graph_harvesting": True, "disable_python_gc": True,
          "data_types.keep_in_fp32_modules": ["norm"], "zero_optimization.compute_grad_norm": False,
          "zero_optimization.parameter_alignment": True, "quantize_training": {},
          "compression_training.shared_parameters": {},
          "timers": {"throughput": {"synchronized": False}}, "autotuning.min_train_batch_size": 2,
          "compile.free_activation_threshold": 1, "compile.offload_activation_pin_memory": False,
          "checkpoint.checkpoint_serialization": False, "checkpoint.writer": {"type": "python"},
          "tensor_parallel.injection_policy_tuple": (object,), "tensor_parallel.tp.mpu": object(),
          "tensor_parallel.tp.tp_group": object()}


def test_every_inert_key_has_an_active_value_here():
    assert {k.path for k in INERT_KEYS} == set(ACTIVE)


@pytest.mark.parametrize("path", sorted(ACTIVE))
def test_inert_key_warns_naming_itself_when_deepspeed_would_act(path):
    config = _nested(path, ACTIVE[path])
    if path.startswith("zero_optimization."):
        config["zero_optimization"]["stage"] = 2
    messages = _warnings_of(config)
    assert len(messages) == 1 and f"'{path}'" in messages[0] and "no effect here" in messages[0], messages


@pytest.mark.parametrize("config", [
    {"hybrid_engine": {"enabled": True, "max_out_tokens": 64}}, {"nebula": {"enabled": False}},
    {"timers": {"throughput": {"enabled": False}}}, {"graph_harvesting": False},
    {"checkpoint": {"checkpoint_serialization": True}},
    {"expert_parallel": {"top_k": "auto", "use_grouped_mm": True}}, {"datastates_ckpt": False},
], ids=lambda c: next(iter(c)))
def test_values_deepspeed_does_not_act_on_do_not_warn(config):
    assert _warnings_of(config) == []


def test_gradient_allreduce_op_is_case_insensitive_and_checked():
    assert load_config({**BASE, "gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"
    assert load_config(BASE).gradient_allreduce_op == "mean"
    # DeepSpeed's wording (its callers match on "Invalid gradient_allreduce_op") after the key path
    expected = (r"gradient_allreduce_op: Invalid gradient_allreduce_op\. "
                r"Supported operations: \['mean', 'sum'\] \(got 'max'\)")
    with pytest.raises(ConfigError, match=expected):
        load_config({**BASE, "gradient_allreduce_op": "max"})


@pytest.mark.parametrize(("extra", "feature"), [
    ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3"),
    ({"compile": {"deepcompile": True}}, "DeepCompile"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {}}}, "ZenFlow"),
], ids=["zero3", "deepcompile", "zenflow"])
def test_gradient_allreduce_sum_refused_where_deepspeed_refuses_it(extra, feature):
    with pytest.raises(ConfigError, match=f"gradient_allreduce_op: 'sum' is not supported with {feature}"):
        load_config({**BASE, "gradient_allreduce_op": "sum", **extra})


def test_log_level_is_case_insensitive_checked_and_kept_as_written():
    assert load_config({**BASE, "log_level": "WARNING"}).log_level == "WARNING"  # engine.log_level() returns it
    assert load_config({**BASE, "log_level": "info"}).log_level == "info"
    with pytest.raises(ConfigError, match="log_level"):
        load_config({**BASE, "log_level": "loud"})


def test_unaligned_vocabulary_size_gets_deepspeeds_warning():
    with pytest.warns(UserWarning, match="vocabulary_size 50257 is not a multiple of 8"):
        load_config({**BASE, "vocabulary_size": 50257})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({**BASE, "vocabulary_size": 50304})


def test_param_dtype_must_match_the_precision():
    assert load_config({**BASE, "bf16": {"enabled": True}, "data_types": {"param_dtype": "bfloat16"}})
    with pytest.raises(ConfigError, match=r"data_types.param_dtype: conflicts with the training precision \(fp32"):
        load_config({**BASE, "data_types": {"param_dtype": "bf16"}})


def test_compute_grad_norm_off_only_with_stage_1_or_2():
    with pytest.raises(ConfigError, match="compute_grad_norm: false is supported only with ZeRO stage 1 or 2"):
        load_config({**BASE, "zero_optimization": {"stage": 0, "compute_grad_norm": False}})


def test_boolean_zero_optimization_takes_allgather_size():
    with pytest.warns(FutureWarning, match="boolean 'zero_optimization' is deprecated"):
        cfg = load_config({**BASE, "zero_optimization": True, "allgather_size": 12345})
    assert cfg.zero_stage == 1 and cfg.zero_optimization.allgather_bucket_size == 12345


def test_checkpoint_writer_values_are_case_insensitive_and_checked():
    cfg = load_config({**BASE, "checkpoint": {"writer": {"type": "mock", "data_parallel": "machine"}}})
    assert (cfg.checkpoint.writer.type, cfg.checkpoint.writer.data_parallel) == ("MOCK", "MACHINE")
    with pytest.raises(ConfigError, match="checkpoint.writer.type"):
        load_config({**BASE, "checkpoint": {"writer": {"type": "turbo"}}})


def test_flops_profiler_step_is_not_a_deepspeed_key_but_the_error_points_to_profile_step():
    """DeepSpeed 0.19 reads flops_profiler.profile_step, never 'step'; the typo is caught and explained."""
    with pytest.raises(ConfigError, match=r"flops_profiler.step: unknown key \(did you mean 'profile_step'\?\)"):
        load_config({**BASE, "flops_profiler": {"step": 2}})


def test_unknown_keys_are_still_errors():
    with pytest.raises(ConfigError, match=r"dataloader_droplast: unknown key \(did you mean 'dataloader_drop_last'"):
        load_config({**BASE, "dataloader_droplast": True})


def test_python_objects_deepspeed_keeps_in_tensor_parallel_stay_out_of_the_json_dump():
    group, mpu = object(), object()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config({**BASE, "tensor_parallel": {"tp": {"tp_group": group, "mpu": mpu}}})
    assert cfg.tensor_parallel.tp.tp_group is group and cfg.tensor_parallel.tp.mpu is mpu
    assert cfg.to_dict()["tensor_parallel"]["tp"] == {"tp_size": 1, "tp_grain_size": 1}

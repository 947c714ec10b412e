"""Section models owned by the top-level config: optimizer, scheduler, precision, parallelism, logging..."""

from __future__ import annotations

import pytest

from ds_config import (
    AioConfig,
    CheckpointConfig,
    ConfigError,
    DeprecatedConfigWarning,
    ElasticityConfig,
    UnknownConfigKeyWarning,
    load_config,
    validate_section,
)
from ds_config.scheduler import OneCycleScheduler, TorchScheduler, WarmupCosineLRScheduler


def _err(config: dict) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_config(config)
    return err.value


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "OneBitAdam", "ZeroOneAdam", "Lamb", "OneBitLamb", "adamw",
                                  "SGD", "RMSprop", "Lion", "Muon"])
def test_every_optimizer_type_is_accepted(kind):
    cfg = load_config({"optimizer": {"type": kind, "params": {"lr": 1e-3}}})
    assert cfg.optimizer.params.lr == 1e-3


def test_optimizer_params_typed_but_open():
    cfg = load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}})
    assert cfg.optimizer.constructor_params() == {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    assert not cfg.optimizer.is_deepspeed_optimizer and cfg.optimizer.name == "SGD"
    err = _err({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}})
    assert err.paths == ["optimizer.params.lr"]
    err = _err({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}})
    assert "betas" in str(err)


def test_optimizer_documented_param_defaults_per_type():
    cfg = load_config({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400}}})
    params = cfg.optimizer.constructor_params()
    assert params["freeze_step"] == 400 and params["cuda_aware"] is False and params["comm_backend_name"] == "nccl"
    assert load_config({"optimizer": {"type": "Adam"}}).optimizer.constructor_params() == {
        "torch_adam": False, "adam_w_mode": True}


def test_optimizer_near_miss_param_warns():
    with pytest.warns(UnknownConfigKeyWarning, match="did you mean 'weight_decay'"):
        load_config({"optimizer": {"type": "Adam", "params": {"weight_decy": 0.1}}})


def test_optimizer_requires_type():
    assert _err({"optimizer": {"params": {}}}).paths == ["optimizer.type"]


@pytest.mark.parametrize(("kind", "params"), [
    ("LRRangeTest", {}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}),
    ("WarmupLR", {"warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 100}),
    ("WarmupCosineLR", {"total_num_steps": 100, "cos_min_ratio": 0.01}),
    ("StepLR", {"step_size": 10}),
])
def test_every_scheduler_type(kind, params):
    cfg = load_config({"scheduler": {"type": kind, "params": params}})
    assert cfg.scheduler.type == kind
    assert cfg.scheduler.constructor_params().items() >= params.items()


def test_scheduler_params_validated_per_type():
    err = _err({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})
    assert err.paths == ["scheduler.params.warmup_num_step"] and "warmup_num_steps" in str(err)
    assert _err({"scheduler": {"type": "WarmupDecayLR", "params": {}}}).paths == \
        ["scheduler.params.total_num_steps"]
    assert _err({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}).paths == \
        ["scheduler.params.warmup_type"]
    assert isinstance(load_config({"scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0, "cycle_max_lr": 1}}}).scheduler, OneCycleScheduler)
    assert isinstance(load_config({"scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 9}}}).scheduler, WarmupCosineLRScheduler)


def test_scheduler_misspelt_name_is_caught():
    assert "spelt 'WarmupLR'" in str(_err({"scheduler": {"type": "warmuplr"}}))
    assert "did you mean 'WarmupDecayLR'" in str(_err({"scheduler": {"type": "WarmupDecayLr2"}}))
    # the problem sits at the key to change and shows the name as written, not the whole section
    assert [str(p) for p in _err({"scheduler": {"type": "WarmupLr"}}).problems] == [
        "scheduler.type: is spelt 'WarmupLR' (scheduler names are case-sensitive) (got 'WarmupLr')"]
    assert isinstance(load_config({"scheduler": {"type": "OneCycleLR", "params": {"max_lr": 1}}}).scheduler,
                      TorchScheduler)


def test_precision_sections():
    cfg = load_config({"fp16": {"enabled": True, "loss_scale": 128, "consecutive_hysteresis": True,
                                "auto_cast": True}})
    assert cfg.precision == "fp16" and not cfg.fp16.dynamic_loss_scale and cfg.fp16.consecutive_hysteresis
    assert _err({"fp16": {"loss_scale": -1}}).paths == ["fp16.loss_scale"]
    amp = load_config({"amp": {"enabled": True, "opt_level": "O1"}}).amp
    assert amp.apex_kwargs() == {"opt_level": "O1"}
    assert _err({"amp": {"opt_level": "O5"}}).paths == ["amp.opt_level"]
    autocast = load_config({"torch_autocast": {"enabled": True, "dtype": "float16"}}).torch_autocast
    assert autocast.dtype == "fp16" and "torch.nn.Linear" in autocast.safe_modules
    assert _err({"torch_autocast": {"dtype": "fp32"}}).paths == ["torch_autocast.dtype"]
    assert load_config({"data_types": {"grad_accum_dtype": "fp32"}}).data_types.grad_accum_dtype == "fp32"


def test_communication_options():
    with pytest.warns(DeprecatedConfigWarning, match="sparse_gradients"):
        cfg = load_config({"communication_data_type": "bfloat16", "gradient_predivide_factor": 2.0,
                           "prescale_gradients": True, "fp32_allreduce": True, "sparse_gradients": True})
    assert cfg.communication_data_type == "bf16" and cfg.gradient_predivide_factor == 2.0
    assert _err({"communication_data_type": "int8"}).paths == ["communication_data_type"]
    assert _err({"gradient_predivide_factor": 0}).paths == ["gradient_predivide_factor"]


def test_tensor_parallel_partition_config():
    cfg = load_config({"tensor_parallel": {"autotp_size": 4, "preset_model": "LLaMA", "partition_config": {
        "use_default_specs": True, "layer_specs": [
            {"patterns": [".*o_proj"], "partition_type": "row"},
            {"patterns": [".*qkv"], "partition_type": "column", "shape": [[8, 2, 2], -1], "partition_dim": 0,
             "model_types": ["llama"]}]}}})
    tp = cfg.tensor_parallel
    assert tp.enabled and tp.preset_model == "llama" and tp.partition_config.layer_specs[1].shape == [[8, 2, 2], -1]
    assert _err({"tensor_parallel": {"preset_model": "gpt5"}}).paths == ["tensor_parallel.preset_model"]
    err = _err({"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": ["x"],
                                                                          "partition_type": "diagonal"}]}}})
    assert err.paths == ["tensor_parallel.partition_config.layer_specs[0].partition_type"]
    assert _err({"tensor_parallel": {"partition_config": {"layer_specs": [
        {"patterns": ["x"], "partition_type": "row", "shape": [2, -1], "partition_dim": 2}]}}}).paths == \
        ["tensor_parallel.partition_config.layer_specs[0]"]


def test_expert_parallel():
    ep = load_config({"expert_parallel": {"enabled": True, "autoep_size": 1, "preset_model": "deepseek_v3"}})
    assert ep.expert_parallel.preset_model == "deepseek_v3"
    assert _err({"expert_parallel": {"load_balance_coeff": 0.1}}).paths == ["expert_parallel.load_balance_coeff"]
    assert _err({"expert_parallel": {"autoep_size": 0}}).paths == ["expert_parallel.autoep_size"]


def test_elasticity_aliases_and_checks():
    cfg = validate_section(ElasticityConfig, {"enabled": True, "prefer_large_batch": False, "version": "0.1"})
    assert cfg.prefer_larger_batch is False and cfg.version == 0.1
    assert _err({"elasticity": {"min_gpus": 8, "max_gpus": 4}}).paths == ["elasticity"]
    assert _err({"elasticity": {"version": 0.3}}).paths == ["elasticity.version"]


def test_small_sections():
    assert validate_section(AioConfig, {"intra_op_parallelism": 4}).thread_count == 4
    assert validate_section(CheckpointConfig, {"tag_validation": "FAIL"}).tag_validation == "Fail"
    assert _err({"checkpoint": {"tag_validation": "maybe"}}).paths == ["checkpoint.tag_validation"]
    assert _err({"pipeline": {"partition": "random"}}).paths == ["pipeline.partition"]
    assert load_config({"pipeline": {"partition": "type:transformer"}}).pipeline.partition == "type:transformer"
    assert _err({"flops_profiler": {"module_depth": -2}}).paths == ["flops_profiler.module_depth"]
    assert _err({"autotuning": {"start_profile_step": 5, "end_profile_step": 3}}).paths == ["autotuning"]
    assert load_config({"comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]}}).comms_logger.prof_ops == [
        "all_reduce"]
    assert load_config({"compile": {"deepcompile": True, "passes": ["autosp"]}}).compile.autosp
    assert load_config({"activation_checkpointing": {"number_checkpoints": 4}}).activation_checkpointing \
        .number_checkpoints == 4


def test_missing_required_key_says_so():
    assert [str(p) for p in _err({"optimizer": {"params": {"lr": 0.1}}}).problems] == [
        "optimizer.type: is required but missing"]

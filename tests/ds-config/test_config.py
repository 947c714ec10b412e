"""The top-level config: input forms, engine-facing properties, "auto", cross-section checks."""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ds_config import (
    ConfigError,
    ConfigSourceError,
    DeepSpeedConfig,
    DeprecatedConfigWarning,
    UnknownConfigKeyWarning,
    load_config,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ds_config.json"
HF_STYLE = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "steps_per_print": float("inf"), "wall_clock_breakdown": False,
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
}


def test_every_input_form_gives_the_same_config(tmp_path):
    data = json.loads(EXAMPLE.read_text())
    text = json.dumps(data)
    path = tmp_path / "c.json"
    path.write_text(text)
    forms = [data, str(path), path, text, base64.b64encode(text.encode()).decode(), text.encode()]
    dumps = {json.dumps(load_config(f).to_dict(), sort_keys=True) for f in forms}
    assert len(dumps) == 1
    assert DeepSpeedConfig.load(data).zero_stage == 2


@pytest.mark.parametrize(("source", "kind"), [
    ("/no/such/ds_config.json", ConfigSourceError),
    ("hello world", ConfigSourceError),
    (42, ConfigSourceError),
    ("{not json", ConfigError),
    ("[1, 2]", ConfigError),
    ('{"steps_per_print": 1, "steps_per_print": 2}', ConfigError),
])
def test_bad_sources(source, kind):
    with pytest.raises(kind) as err:
        load_config(source)
    assert err.type is kind


def test_duplicate_key_names_the_key():
    with pytest.raises(ConfigError, match="steps_per_print: is given twice"):
        load_config('{"steps_per_print": 1, "steps_per_print": 2}')


def test_defaults_filled_in_and_typed_engine_view():
    cfg = load_config({})
    assert cfg.steps_per_print == 10 and cfg.gradient_clipping == 0.0 and cfg.zero_stage == 0
    assert not (cfg.fp16_enabled or cfg.bf16_enabled or cfg.amp_enabled or cfg.torch_autocast_enabled)
    assert cfg.precision == "fp32" and cfg.optimizer is None and cfg.scheduler is None
    assert cfg.zero_force_ds_cpu_optimizer is True and cfg.zero_allow_untested_optimizer is False
    resolved = cfg.to_dict()
    assert resolved["fp16"]["loss_scale_window"] == 1000 and resolved["aio"]["block_size"] == 1048576
    assert "bfloat16" not in resolved


def test_steps_per_print_accepts_infinity_as_accelerate_writes_it():
    assert load_config({"steps_per_print": float("inf")}).steps_per_print == math.inf
    assert load_config('{"steps_per_print": Infinity}').steps_per_print == math.inf
    assert load_config({"steps_per_print": 5.0}).steps_per_print == 5
    with pytest.raises(ConfigError, match="steps_per_print"):
        load_config({"steps_per_print": 0})


def test_hugging_face_auto_config():
    cfg = load_config(HF_STYLE)
    assert cfg.fp16.enabled is False and cfg.zero_stage == 3  # "auto" inside a section: the default
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    keys = cfg.auto_keys()
    assert set(keys) == {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                         "gradient_clipping", "optimizer.params.lr", "optimizer.params.betas",
                         "optimizer.params.eps", "optimizer.params.weight_decay",
                         "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
                         "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps"}
    with pytest.raises(ConfigError) as err:
        cfg.require_resolved()
    assert set(err.value.paths) == set(keys)


def test_require_resolved_passes_when_filled():
    load_config(EXAMPLE).require_resolved()


def test_deprecated_bfloat16_moves_to_bf16():
    with pytest.warns(DeprecatedConfigWarning, match="use 'bf16'"):
        cfg = load_config({"bfloat16": {"enabled": True}})
    assert cfg.bf16_enabled and cfg.precision == "bf16"
    with pytest.warns(DeprecatedConfigWarning), pytest.raises(ConfigError, match="give only 'bf16'"):
        load_config({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})


def test_unknown_top_level_key_suggests_and_strict_false_warns():
    with pytest.raises(ConfigError, match="did you mean 'gradient_clipping'"):
        load_config({"gradient_cliping": 1.0})
    with pytest.warns(UnknownConfigKeyWarning, match="gradient_cliping"):
        cfg = load_config({"gradient_cliping": 1.0, "fp16": {"enabled": True}}, strict=False)
    assert cfg.fp16_enabled


@pytest.mark.parametrize(("config", "path", "why"), [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled", "cannot both be enabled"),
    ({"amp": {"enabled": True}, "fp16": {"enabled": True}}, "amp.enabled", "cannot be combined with fp16"),
    ({"amp": {"enabled": True}, "zero_optimization": {"stage": 1}}, "amp.enabled", "not compatible with ZeRO"),
    ({"pipeline": {"stages": 4}, "zero_optimization": {"stage": 2}}, "zero_optimization.stage", "stage 0 or 1"),
    ({"tensor_parallel": {"autotp_size": 4}, "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0},
     "gradient_clipping", "tensor-parallel group"),
    ({"tensor_parallel": {"autotp_size": 4}, "zero_optimization": {"stage": 3}, "fp16": {"enabled": True}},
     "fp16.enabled", "tensor-parallel group"),
    ({"compile": {"deepcompile": True, "passes": ["autosp"]}, "zero_optimization": {"stage": 2}},
     "compile.passes", "ZeRO stage 0 or 1"),
    ({"elasticity": {"enabled": True}, "train_batch_size": 8}, "train_batch_size", "elastic"),
])
def test_incompatible_combinations_say_why(config, path, why):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert path in err.value.paths
    assert why in str(err.value)


def test_compatible_combinations():
    load_config({"tensor_parallel": {"autotp_size": 4}, "zero_optimization": {"stage": 2}})
    load_config({"tensor_parallel": {"autotp_size": 4}, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    load_config({"expert_parallel": {"enabled": True, "autoep_size": 4, "preset_model": "Mixtral"}})
    load_config({"pipeline": {"stages": 4}, "zero_optimization": {"stage": 1}})
    load_config({"elasticity": {"enabled": True, "ignore_non_elastic_batch_info": True}, "train_batch_size": 8})


def test_pipeline_check_for_the_engine():
    cfg = load_config({"zero_optimization": {"stage": 2}})
    cfg.check_pipeline(1)
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        cfg.check_pipeline(2)


def test_importing_ds_config_does_not_import_torch():
    code = "import sys, ds_config, ds_config.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_accelerate_style_config():
    # What Accelerate's DeepSpeedPlugin writes: infinity, "none" offload devices below stage 3, auto batch keys.
    cfg = load_config({
        "fp16": {"enabled": True, "auto_cast": True}, "bf16": {"enabled": False},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "nvme_path": None},
                              "offload_param": {"device": "none", "nvme_path": None},
                              "stage3_gather_16bit_weights_on_model_save": False},
        "gradient_clipping": 1.0, "steps_per_print": float("inf"), "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1})
    assert cfg.fp16.auto_cast and cfg.steps_per_print == math.inf
    assert cfg.auto_keys() == ["train_batch_size", "train_micro_batch_size_per_gpu"]
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu = 16, 4  # what Accelerate fills in
    cfg.require_resolved()
    assert cfg.resolve_batch(4).gradient_accumulation_steps == 1


def test_schema_reference_key_is_accepted_and_dropped():
    cfg = load_config({"$schema": "./ds_config.schema.json"})
    assert cfg.json_schema_ref == "./ds_config.schema.json" and "$schema" not in cfg.to_dict()


def test_engine_accessors():
    cfg = load_config({"fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 3},
                       "optimizer": {"type": "OneBitLamb", "params": {"lr": 0.01}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}})
    assert cfg.initial_dynamic_scale == 4096.0
    assert cfg.dynamic_loss_scale_args == {"init_scale": 4096.0, "scale_window": 1000, "delayed_shift": 3,
                                           "consecutive_hysteresis": False, "min_scale": 1000}
    assert cfg.optimizer_name == "onebitlamb" and cfg.optimizer_params["max_coeff"] == 10.0
    assert cfg.scheduler_name == "WarmupLR" and cfg.scheduler_params["warmup_num_steps"] == 5
    assert cfg.scheduler_params["warmup_type"] == "log"
    static = load_config({"fp16": {"enabled": True, "loss_scale": 256}})
    assert static.dynamic_loss_scale_args is None and static.optimizer_name is None


def test_a_field_error_does_not_hide_cross_section_or_batch_problems():
    # one run of the validator should show everything the user has to fix, not one problem per run
    data = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": "yes"}},
            "fp16": {"enabled": True}, "bf16": {"enabled": True},
            "train_batch_size": 12, "train_micro_batch_size_per_gpu": 4}
    with pytest.raises(ConfigError) as err:
        load_config(data, world_size=8)
    assert err.value.paths == ["zero_optimization.offload_param.pin_memory", "bf16.enabled",
                               "gradient_accumulation_steps"]
    assert "0.375 is not a whole number" in str(err.value)
    with pytest.raises(ConfigError) as err:  # without a world size the batch is not checked
        load_config(data)
    assert err.value.paths == ["zero_optimization.offload_param.pin_memory", "bf16.enabled"]


def test_sections_with_errors_take_no_part_in_cross_section_checks():
    # amp + ZeRO conflicts only through zero_optimization.stage, which is in a section that failed: no guess
    data = {"amp": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": "x"}}
    with pytest.raises(ConfigError) as err:
        load_config(data)
    assert err.value.paths == ["zero_optimization.reduce_bucket_size"]


def test_deepcompile_with_autoep_autotp_folding_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"compile\.deepcompile.*AutoEP\+AutoTP folding"):
        load_config({"train_micro_batch_size_per_gpu": 1, "compile": {"deepcompile": True},
                     "expert_parallel": {"enabled": True, "autoep_size": 2}, "tensor_parallel": {"autotp_size": 2}})

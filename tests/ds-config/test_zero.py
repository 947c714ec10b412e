"""zero_optimization: aliases, deprecated names, "auto", integral floats and the checks that need the stage."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
from _ds_config_testing import config_error

from ds_config._base import DeprecatedConfigWarning, UnknownConfigKeyWarning, validate_section
from ds_config._errors import ConfigError
from ds_config.zero import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    OffloadDeviceEnum,
    ZenFlowConfig,
    ZeroStageEnum,
)

P = "zero_optimization"


def zero(data, **kw) -> DeepSpeedZeroConfig:
    return validate_section(DeepSpeedZeroConfig, data, path=P, **kw)


def error(data) -> ConfigError:
    return config_error(zero, data)


# -- aliases, "auto", numbers -------------------------------------------------------------------------

STAGE3_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
}


@pytest.mark.parametrize("alias,name", sorted(STAGE3_ALIASES.items()))
def test_stage3_alias_and_field_name_both_set_the_field(alias, name):
    assert getattr(zero({"stage": 3, alias: 1234}), name) == 1234
    assert getattr(zero({"stage": 3, name: 4321}), name) == 4321


@pytest.mark.parametrize("alias,name", [
    ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"),
    ("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"),
    ("stage3_allgather_sequential", "allgather_sequential"),
])
def test_stage3_boolean_aliases(alias, name):
    assert getattr(zero({alias: True}), name) is True


def test_transformers_zero3_template_with_auto_and_float_sizes():
    cfg = zero({
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    })
    assert cfg.stage == ZeroStageEnum.weights and cfg.stage == 3
    assert cfg.reduce_bucket_size == 500_000_000 and cfg.prefetch_bucket_size == 50_000_000
    assert cfg.param_persistence_threshold == 100_000
    assert isinstance(cfg.sub_group_size, int) and cfg.max_live_parameters == 1_000_000_000
    assert cfg.offload_param_enabled and cfg.offload_optimizer_enabled and cfg.offload_param.pin_memory


def test_auto_inside_offload_sections_means_default():
    cfg = zero({"stage": 3, "offload_param": {"device": "auto", "buffer_count": "auto"}})
    assert cfg.offload_param.device == OffloadDeviceEnum.none and cfg.offload_param.buffer_count == 5


def test_overlap_comm_follows_stage_unless_given():
    assert zero({"stage": 3}).overlap_comm is True
    assert zero({"stage": 2}).overlap_comm is False
    assert zero({"stage": 3, "overlap_comm": False}).overlap_comm is False


def test_boolean_section_is_the_old_stage_one_switch():
    with pytest.warns(DeprecatedConfigWarning):
        assert zero(True).stage == 1
    with pytest.warns(DeprecatedConfigWarning):
        assert zero(False).stage == 0


def test_leaf_module_defaults_and_values():
    assert zero({}).leaf_module.classes == list(DEFAULT_LEAF_MODULE_CLASSES)
    leaf = zero({"stage": 3, "leaf_module": {"classes": ["my.Block"], "names": "layers.0.experts",
                                             "name_suffixes": ["experts"]}}).leaf_module
    assert leaf.classes == ["my.Block"] and leaf.names == ["layers.0.experts"] and leaf.name_suffixes == ["experts"]


def test_loco_param_defaults_filled_and_checked():
    assert zero({"zeropp_loco_param": {"err_beta": 0.5}}).zeropp_loco_param == {"err_beta": 0.5, "reset_T": 1024}
    err = error({"zeropp_loco_param": {"err_beta": 0.8, "reset_t": 10}})
    assert err.paths == [f"{P}.zeropp_loco_param"] and "reset_T" in str(err)


def test_zenflow_section():
    cfg = zero({"stage": 2, "zenflow": {"topk_ratio": 0.05, "update_interval": 4, "select_interval": "auto"}})
    assert isinstance(cfg.zenflow, ZenFlowConfig)
    assert cfg.zenflow.topk_ratio == 0.05 and cfg.zenflow.update_interval == 4 and cfg.zenflow.select_interval == "auto"
    assert error({"zenflow": {"select_strategy": "epoch"}}).paths == [f"{P}.zenflow.select_interval"]
    assert error({"zenflow": {"topk_ratio": 2}}).paths == [f"{P}.zenflow.topk_ratio"]


# -- deprecated names ---------------------------------------------------------------------------------

def test_cpu_offload_moves_to_offload_optimizer_with_warning():
    with pytest.warns(DeprecatedConfigWarning, match="offload_optimizer"):
        cfg = zero({"stage": 2, "cpu_offload": True})
    assert cfg.offload_optimizer.device == OffloadDeviceEnum.cpu and not cfg.offload_optimizer.pin_memory


def test_cpu_offload_param_and_pin_memory_move_over():
    with pytest.warns(DeprecatedConfigWarning) as record:
        cfg = zero({"stage": 3, "cpu_offload_param": True, "cpu_offload": True, "cpu_offload_use_pin_memory": True})
    text = " ".join(str(w.message) for w in record)
    assert "offload_param" in text and "pin_memory" in text
    assert cfg.offload_param.device == OffloadDeviceEnum.cpu and cfg.offload_param.pin_memory
    assert cfg.offload_optimizer.device == OffloadDeviceEnum.cpu and cfg.offload_optimizer.pin_memory


@pytest.mark.parametrize("data,key,new,why", [
    ({"cpu_offload": True}, "cpu_offload", "offload_optimizer", "stage 1, 2 or 3 (stage is 0)"),
    ({"stage": 0, "cpu_offload": True, "cpu_offload_use_pin_memory": True}, "cpu_offload", "offload_optimizer",
     "stage 1, 2 or 3 (stage is 0)"),
    ({"stage": 0, "cpu_offload_param": True}, "cpu_offload_param", "offload_param", "stage 3 only (stage is 0)"),
    ({"stage": 2, "cpu_offload_param": True}, "cpu_offload_param", "offload_param", "stage 3 only (stage is 2)"),
    ({"stage": "auto", "cpu_offload_param": True}, "cpu_offload_param", "offload_param", "(stage is 0)"),
])
def test_deprecated_offload_switch_at_a_stage_that_cannot_use_it_warns_and_is_ignored(data, key, new, why):
    # DeepSpeed accepts these at any stage (old configs keep them while the launcher picks the stage): warn with the
    # replacement's name, and leave the replacement off rather than reject the config
    with pytest.warns(DeprecatedConfigWarning) as record:
        cfg = zero(data)
    text = [str(w.message) for w in record]
    assert any(f"'{key}' is deprecated; use '{new}' instead" in t and why in t and "ignored" in t for t in text), text
    assert cfg.offload_param is None and cfg.offload_optimizer is None
    assert cfg.stage == (0 if data.get("stage", 0) in (0, "auto") else data["stage"])


def test_deprecated_offload_switches_migrate_where_the_stage_honours_them():
    # stage 2: cpu_offload moves over, cpu_offload_param (stage 3 only) is ignored, both with their warning
    with pytest.warns(DeprecatedConfigWarning) as record:
        cfg = zero({"stage": 2, "cpu_offload": True, "cpu_offload_param": True})
    text = " | ".join(str(w.message) for w in record)
    assert "'cpu_offload' is deprecated; use 'offload_optimizer' instead" in text
    assert "'cpu_offload_param' is deprecated; use 'offload_param' instead" in text and "stage is 2" in text
    assert cfg.offload_optimizer.device == OffloadDeviceEnum.cpu and cfg.offload_param is None
    # and a dump of the result validates again without any deprecated key
    dumped = cfg.model_dump(mode="json", by_alias=True)
    assert "cpu_offload" not in dumped and zero(dumped).offload_optimizer.device == OffloadDeviceEnum.cpu


def test_deprecated_offload_switch_set_to_false_is_accepted_at_stage_0():
    with pytest.warns(DeprecatedConfigWarning, match="offload_optimizer"):
        cfg = zero({"stage": 0, "cpu_offload": False})
    assert cfg.offload_optimizer is None


def test_offload_optimizer_pipeline_is_read_or_write():
    for read, write in ((False, False), (True, False), (False, True), (True, True)):
        section = {"device": "nvme", "nvme_path": "/nvme", "pipeline_read": read, "pipeline_write": write}
        off = zero({"stage": 3, "offload_optimizer": section}).offload_optimizer
        assert off.pipeline is (read or write)
    off = DeepSpeedZeroOffloadOptimizerConfig()
    assert off.pipeline is False
    off.pipeline_write = True  # derived on read: follows assignments
    assert off.pipeline is True
    assert "pipeline" not in off.model_dump()  # derived, not a key: a dump validates again
    with pytest.raises(ConfigError, match="pipeline"):
        zero({"stage": 3, "offload_optimizer": {"pipeline": True}})


def test_fp16_weights_flag_moves_to_16bit_flag():
    with pytest.warns(DeprecatedConfigWarning, match="gather_16bit_weights_on_model_save"):
        assert zero({"stage3_gather_fp16_weights_on_model_save": True}).gather_16bit_weights_on_model_save


@pytest.mark.parametrize("new_key", ["gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"])
def test_deprecated_and_replacement_together_is_an_error(new_key):
    err = error({"stage3_gather_fp16_weights_on_model_save": True, new_key: False})
    assert err.paths == [P] and new_key in str(err)


def test_deprecated_key_with_its_default_value_is_harmless():
    cfg = zero({"stage": 3, "cpu_offload": None, "stage3_gather_fp16_weights_on_model_save": False,
                "offload_optimizer": {"device": "cpu"}, "gather_16bit_weights_on_model_save": True})
    assert cfg.offload_optimizer.device == OffloadDeviceEnum.cpu and cfg.gather_16bit_weights_on_model_save


def test_dump_leaves_deprecated_keys_out_and_validates_again():
    with pytest.warns(DeprecatedConfigWarning):
        cfg = zero({"stage": 3, "cpu_offload": True})
    dumped = cfg.model_dump(mode="json", by_alias=True)
    assert "cpu_offload" not in dumped and dumped["stage3_prefetch_bucket_size"] == 50_000_000
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zero(dumped).model_dump(mode="json", by_alias=True) == dumped


def test_assignment_is_validated():
    with pytest.warns(DeprecatedConfigWarning):
        cfg = zero({"stage": 3, "cpu_offload": True})
    cfg.reduce_bucket_size = 1e6
    assert cfg.reduce_bucket_size == 1_000_000
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        cfg.reduce_bucket_size = -5


# -- errors with full key paths -----------------------------------------------------------------------

@pytest.mark.parametrize("data,path,words", [
    ({"stage": 4}, "stage", "0, 1, 2 or 3"),
    ({"stage": -1}, "stage", "0, 1, 2 or 3"),
    ({"stage": True}, "stage", "0, 1, 2 or 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param.device", "stage 3"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "offload_param.device", "nvme_path"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ""}}, "offload_optimizer.device", "nvme_path"),
    ({"stage": 3, "offload_param": {"device": "gpu"}}, "offload_param.device", "'cpu'"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}, "offload_optimizer.device",
     "stage 3"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer.device", "stage 1, 2 or 3"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "offload_optimizer.ratio", "less than"),
    ({"stage": 3, "offload_optimizer": {"cpuadam_cores_perc": -0.1}}, "offload_optimizer.cpuadam_cores_perc",
     "greater than"),
    ({"reduce_bucket_size": -1}, "reduce_bucket_size", "greater than or equal to 0"),
    ({"allgather_bucket_size": 5.5e0}, "allgather_bucket_size", "fractional"),
    ({"sub_group_size": True}, "sub_group_size", "not a boolean"),
    ({"stage": 3, "offload_param": {"buffer_count": -2}}, "offload_param.buffer_count", "greater than"),
    ({"stage3_max_live_parameters": -1}, "stage3_max_live_parameters", "greater than"),
    ({"mics_shard_size": 8}, "mics_shard_size", "stage 3"),
    ({"mics_shard_size": -3}, "mics_shard_size", "greater than"),
    ({"stage": 3, "mics_hierarchical_params_gather": True}, "mics_hierarchical_params_gather", "mics_shard_size"),
    ({"contiguous_gradients": "yes"}, "contiguous_gradients", "boolean"),
    ({"leaf_module": {"classes": ["ok", " "]}}, "leaf_module.classes", "empty"),
    ({"stgae": 3}, "stgae", "did you mean 'stage'"),
    ({"offload_param": {"nvme_pth": "/x"}}, "offload_param.nvme_pth", "did you mean 'nvme_path'"),
])
def test_errors_name_the_full_key_path(data, path, words):
    err = error(data)
    assert f"{P}.{path}" in err.paths, err
    assert words in str(err)


def test_several_problems_reported_together():
    err = error({"stage": 2, "offload_param": {"device": "cpu"},
                 "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}})
    assert set(err.paths) == {f"{P}.offload_param.device", f"{P}.offload_optimizer.device"}


@pytest.mark.parametrize(("stage", "extra", "key"), [(1, {"ratio": 0.3}, "ratio"),
                                                     (2, {"super_offload": True}, "super_offload")])
def test_stage3_offload_options_below_stage3_are_ignored_as_in_deepspeed(stage, extra, key):
    """DeepSpeed's ZeRO-1/2 offload the whole optimizer and never read ratio / super_offload: accepted, with a
    warning naming the key (it has no effect)."""
    from ds_config import InertConfigKeyWarning

    with pytest.warns(InertConfigKeyWarning, match=rf"offload_optimizer\.{key}' has no effect with ZeRO stage"):
        cfg = zero({"stage": stage, "offload_optimizer": {"device": "cpu", **extra}})
    assert cfg.offload_optimizer.device == OffloadDeviceEnum.cpu


def test_non_strict_mode_warns_and_drops_unknown_keys():
    with pytest.warns(UnknownConfigKeyWarning, match=r"zero_optimization\.offload_param\.future_knob"):
        cfg = zero({"stage": 3, "offload_param": {"device": "cpu", "future_knob": 1}}, strict=False)
    assert cfg.offload_param.device == OffloadDeviceEnum.cpu


def test_valid_stage3_features_together():
    cfg = zero({"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": True,
                "zero_hpz_partition_size": 8, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "ratio": 0.3, "super_offload": True,
                                      "cpuadam_cores_perc": 0.5, "pipeline_read": True, "fast_init": True},
                "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_size": 1e8, "max_in_cpu": 1e9}})
    opt = cfg.offload_optimizer
    assert isinstance(opt, DeepSpeedZeroOffloadOptimizerConfig) and str(opt.nvme_path) == "/nvme"
    assert opt.ratio == 0.3 and cfg.offload_param.buffer_size == 100_000_000 and cfg.mics_shard_size == 8


def test_importing_config_modules_does_not_import_torch():
    code = ("import sys, ds_config.zero, ds_config.inference, ds_config.monitor; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0

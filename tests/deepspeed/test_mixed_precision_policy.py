"""DeepSpeedEngine's mixed-precision policy under DeepSpeed's method names (issue 26): ``_mixed_precision_dtypes``,
``_assert_valid_mixed_precision_config`` and ``_cast_module_mixed_precision`` are what ``deepspeed.initialize``
runs (parameters in the fp16/bf16 training dtype, buffers as loaded unless ``data_types.buffer_dtype`` names one),
and ``engine.log_level()`` with the logger level it sets."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from _harness import run_distributed
from torch import nn

from deepspeed.runtime.engine import DeepSpeedEngine
from ds_config import ConfigError


def _stand_in(param_dtype=None, buffer_dtype=None, fp16=False, bf16=False, module=None):
    # the methods read only these attributes, so that DeepSpeed's callers can pass a stand-in
    config = types.SimpleNamespace(param_dtype=param_dtype, buffer_dtype=buffer_dtype)
    return types.SimpleNamespace(_config=config, fp16_enabled=lambda: fp16, bfloat16_enabled=lambda: bf16,
                                 module=module)


def _rope_like() -> nn.Module:
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    module.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32))
    module.register_buffer("positions", torch.arange(4))  # an integer buffer is never cast
    return module


@pytest.mark.parametrize("fp16,bf16,expected", [(True, False, torch.float16), (False, True, torch.bfloat16),
                                                (False, False, None)])
def test_param_dtype_follows_the_enabled_flag_and_buffers_default_to_none(fp16, bf16, expected):
    assert DeepSpeedEngine._mixed_precision_dtypes(_stand_in(fp16=fp16, bf16=bf16)) == (expected, None)


@pytest.mark.parametrize("name,expected", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32),
                                           ("torch.bfloat16", torch.bfloat16), ("half", torch.float16),
                                           ("float", torch.float32)])
def test_buffer_dtype_names_resolve_as_deepspeeds_dtype_enum(name, expected):
    assert DeepSpeedEngine._mixed_precision_dtypes(_stand_in(buffer_dtype=name, bf16=True))[1] == expected


@pytest.mark.parametrize("param_dtype,fp16,bf16", [(None, False, True), ("bf16", False, True),
                                                   ("bfloat16", False, True), ("fp16", True, False),
                                                   ("fp32", False, False)])
def test_param_dtype_matching_the_training_dtype_is_accepted(param_dtype, fp16, bf16):
    assert DeepSpeedEngine._assert_valid_mixed_precision_config(_stand_in(param_dtype, fp16=fp16, bf16=bf16)) is None


@pytest.mark.parametrize("param_dtype,fp16,bf16,model", [("fp16", False, True, "torch.bfloat16"),
                                                         ("fp32", False, True, "torch.bfloat16"),
                                                         ("bf16", True, False, "torch.float16"),
                                                         ("bf16", False, False, "torch.float32")])
def test_param_dtype_off_the_training_dtype_is_deepspeeds_assertion_naming_the_key(param_dtype, fp16, bf16, model):
    with pytest.raises(AssertionError) as err:
        DeepSpeedEngine._assert_valid_mixed_precision_config(_stand_in(param_dtype, fp16=fp16, bf16=bf16))
    assert isinstance(err.value, ConfigError)
    assert f"data_types.param_dtype: conflicts with the training dtype {model}" in str(err.value)
    assert repr(param_dtype) in str(err.value)


def test_cast_moves_parameters_and_leaves_buffers_unless_asked():
    module = _rope_like()
    buffer = module.inv_freq
    DeepSpeedEngine._cast_module_mixed_precision(_stand_in(module=module), torch.bfloat16, None, False)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in module.buffers() if b.is_floating_point()} == {torch.float32}
    DeepSpeedEngine._cast_module_mixed_precision(_stand_in(module=module), None, torch.float16, False)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}  # None leaves the parameters
    assert module.inv_freq is buffer and buffer.dtype == torch.float16  # cast in place: the same buffer object
    assert module[1].running_var.dtype == torch.float16
    assert module.positions.dtype == torch.int64


def test_cast_leaves_the_parameters_of_a_zero_init_model():
    module = _rope_like()
    DeepSpeedEngine._cast_module_mixed_precision(_stand_in(module=module), torch.bfloat16, torch.bfloat16, True)
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert module.inv_freq.dtype == torch.bfloat16  # buffers are never partitioned: still cast


def _initialize(config_extra: dict, zero_init: bool = False) -> dict:
    import deepspeed

    calls = []
    original = DeepSpeedEngine._cast_module_mixed_precision

    def recording(self, param_dtype, buffer_dtype, is_zero_init_model):
        calls.append((param_dtype, buffer_dtype, is_zero_init_model))
        original(self, param_dtype, buffer_dtype, is_zero_init_model)

    DeepSpeedEngine._cast_module_mixed_precision = recording  # this rank's process only
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, **config_extra}
    if zero_init:  # built as fp32 partitions: the engine's adoption, not the module cast, makes them bf16
        with deepspeed.zero.Init(dtype=torch.float32):
            model = _rope_like()
    else:
        model = _rope_like()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return {"calls": calls, "params": {p.dtype for p in engine.module.parameters()},
            "partitions": {p.ds_tensor.dtype for p in engine.module.parameters() if hasattr(p, "ds_tensor")},
            "inv_freq": engine.module.inv_freq.dtype, "running_mean": engine.module[1].running_mean.dtype,
            "config": (engine._config.param_dtype, engine._config.buffer_dtype)}


@pytest.mark.parametrize("stage", [0, 3])
def test_initialize_casts_through_deepspeeds_methods(stage):
    out = run_distributed(_initialize, world_size=1, args=({"zero_optimization": {"stage": stage}},), timeout=120)[0]
    assert out["calls"] == [(torch.bfloat16, None, False)]
    assert out["params"] == {torch.bfloat16}
    assert (out["inv_freq"], out["running_mean"]) == (torch.float32, torch.float32)
    assert out["config"] == (None, None)
    if stage == 3:
        assert out["partitions"] == {torch.bfloat16}


def test_initialize_buffer_dtype_and_matching_param_dtype():
    extra = {"data_types": {"param_dtype": "bf16", "buffer_dtype": "bf16"}}
    out = run_distributed(_initialize, world_size=1, args=(extra,), timeout=120)[0]
    assert out["calls"] == [(torch.bfloat16, torch.bfloat16, False)]
    assert (out["inv_freq"], out["running_mean"]) == (torch.bfloat16, torch.bfloat16)
    assert out["config"] == ("bf16", "bf16")


def test_zero_init_model_skips_the_module_cast_and_zero3_adopts_it_in_the_training_dtype():
    out = run_distributed(_initialize, world_size=1, args=({"zero_optimization": {"stage": 3}}, True), timeout=120)[0]
    assert out["calls"] == [(torch.bfloat16, None, True)]
    assert out["partitions"] == {torch.bfloat16} and out["params"] == {torch.bfloat16}
    assert out["inv_freq"] == torch.float32


def _log_levels(log_level: str | None) -> tuple:
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.DEBUG)
    for handler in logger.handlers:
        handler.setLevel(logging.DEBUG)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if log_level is not None:
        config["log_level"] = log_level
    engine, *_ = deepspeed.initialize(model=nn.Linear(2, 2), config=config)
    return engine.log_level(), logger.getEffectiveLevel(), {h.level for h in logger.handlers}


@pytest.mark.parametrize("written,level", [("ERROR", logging.ERROR), ("info", logging.INFO), (None, logging.DEBUG)])
def test_log_level_is_returned_as_written_and_sets_the_logger_and_its_handlers(written, level):
    got, effective, handlers = run_distributed(_log_levels, world_size=1, args=(written,), timeout=90)[0]
    assert got == written  # None: the logger keeps the level it had
    assert effective == level
    assert handlers <= {level}


def test_log_level_getter_reads_the_config():
    assert DeepSpeedEngine.log_level(types.SimpleNamespace(_config=types.SimpleNamespace(log_level="ERROR"))) == "ERROR"

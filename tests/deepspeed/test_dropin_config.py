"""Drop-in config modules: ``deepspeed.runtime.config.DeepSpeedConfig(config, mpu=None, mesh_device=None)`` built
from a path or a dict as DeepSpeed's is, the optimizer-name constants, ``deepspeed.runtime.constants`` (every
default equal to the schema's), ``deepspeed.runtime.config_utils`` and ``deepspeed.runtime.precision_config``."""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

import deepspeed.runtime.config as rc
import deepspeed.runtime.config_utils as cu
import deepspeed.runtime.constants as C
import deepspeed.runtime.precision_config as pc
import ds_config
import ds_config.config
import ds_config.config_utils
from deepspeed.runtime.config import DeepSpeedConfig
from ds_config import ConfigError, DeprecatedConfigWarning, load_config
from ds_config.optimizer import DEEPSPEED_OPTIMIZERS as SCHEMA_OPTIMIZERS


class _Mpu:
    """The data-parallel part of a Megatron-style mpu."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


# (config, world size) -> the resolved (train_batch_size, micro batch per GPU, gradient accumulation steps)
BATCH_CASES = [
    ({"train_batch_size": 32}, 1, (32, 32, 1)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 1, (32, 16, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 1, (32, 4, 8)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4}, 4, (16, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 4, (48, 4, 3)),
]


def _triple(cfg: DeepSpeedConfig) -> tuple[int, int, int]:
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@pytest.mark.parametrize(("data", "world", "expected"), BATCH_CASES)
def test_batch_triple_from_a_dict_and_a_path(tmp_path, data, world, expected):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    mpu = _Mpu(world) if world > 1 else None
    for source in (dict(data), str(path), path):
        cfg = DeepSpeedConfig(source, mpu=mpu)
        assert cfg.world_size == world and cfg.global_rank == 0
        assert _triple(cfg) == expected
        assert cfg.typed_config.batch.world_size == world  # the typed config the engine uses, resolved alike


def test_other_sources_and_the_user_dict_is_kept():
    data = {"train_batch_size": 8, "fp16": {"enabled": True}}
    cfg = DeepSpeedConfig(data)
    assert cfg._param_dict is data and data == {"train_batch_size": 8, "fp16": {"enabled": True}}  # untouched
    encoded = base64.urlsafe_b64encode(json.dumps(data).encode()).decode()
    assert _triple(DeepSpeedConfig(encoded)) == (8, 8, 1)  # what the launcher passes on the command line
    with pytest.raises(ValueError, match="config file not found"):
        DeepSpeedConfig("/no/such/ds_config.json")


def test_schema_errors_are_the_same():
    bad = {"train_batch_size": 8, "zero_optimization": {"stgae": 2}, "fp16": {"enabled": "yes"}}
    with pytest.raises(ConfigError) as direct:
        load_config(bad, world_size=1)
    with pytest.raises(ConfigError) as via_class:
        DeepSpeedConfig(bad)
    assert sorted(via_class.value.paths) == sorted(direct.value.paths) == ["fp16.enabled", "zero_optimization.stgae"]
    assert str(via_class.value) == str(direct.value)


def test_batch_arithmetic_is_checked_with_the_data_parallel_size():
    data = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError, match=r"data-parallel world size \(1\)"):
        DeepSpeedConfig(data)
    assert _triple(DeepSpeedConfig(data, mpu=_Mpu(4))) == (32, 4, 2)


def test_world_size_from_torch_distributed_and_mesh(monkeypatch):
    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 5,
                                 get_world_size=lambda group=None: {None: 8, "dp": 2}[group])
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    cfg = DeepSpeedConfig({"train_batch_size": 16})
    assert (cfg.global_rank, cfg.world_size, cfg.train_micro_batch_size_per_gpu) == (5, 8, 2)

    class Mesh:
        def get_group(self, mesh_dim):
            assert mesh_dim == "data_parallel"
            return "dp"

    assert DeepSpeedConfig({"train_batch_size": 16}, mesh_device=Mesh()).world_size == 2
    assert DeepSpeedConfig({"train_batch_size": 16}, mpu=_Mpu(4)).world_size == 4  # the mpu wins

    class UlyssesMpu:  # sequence parallelism only: the rest of the world is data parallel
        def get_sequence_parallel_world_size(self):
            return 4

    assert DeepSpeedConfig({"train_batch_size": 16}, mpu=UlyssesMpu()).world_size == 2


def _in_a_real_group():
    cfg = DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2})
    return cfg.global_rank, cfg.world_size, _triple(cfg)


def test_world_size_from_a_real_process_group():
    got = run_distributed(_in_a_real_group, world_size=2, timeout=60)
    assert got == [(0, 2, (8, 2, 2)), (1, 2, (8, 2, 2))]
    assert not dist.is_initialized()


def test_attributes_client_code_reads():
    cfg = DeepSpeedConfig({
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 50, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
        "fp16": {"enabled": True, "auto_cast": True, "loss_scale_window": 500, "initial_scale_power": 12},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "communication_data_type": "bfloat16", "flops_profiler": {"enabled": True}, "memory_breakdown": True,
        "pipeline": {"activation_checkpoint_interval": 2}, "checkpoint": {"tag_validation": "fail"},
    })
    assert (cfg.zero_optimization_stage, cfg.zero_enabled) == (2, True)
    assert isinstance(cfg.zero_config, ds_config.DeepSpeedZeroConfig) and cfg.zero_config.offload_optimizer_enabled
    assert (cfg.fp16_enabled, cfg.bfloat16_enabled, cfg.fp16_auto_cast, cfg.loss_scale) == (True, False, True, 0)
    assert cfg.initial_dynamic_scale == 2**12
    assert cfg.dynamic_loss_scale_args == {"init_scale": 4096, "scale_window": 500, "delayed_shift": 2,
                                           "consecutive_hysteresis": False, "min_scale": 1000}
    assert cfg.float16_config is cfg.typed_config.fp16 and isinstance(cfg.bfloat16_config, pc.DeepSpeedBF16Config)
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 50
    assert cfg.optimizer_name == rc.ADAMW_OPTIMIZER  # DeepSpeed's own optimizers are lower-cased
    assert cfg.optimizer_params == {"lr": 3e-4, "betas": [0.9, 0.95]}  # as written, no defaults added
    assert (cfg.scheduler_name, cfg.scheduler_params) == ("WarmupLR", {"warmup_num_steps": 100})
    assert cfg.wall_clock_breakdown is True and cfg.memory_breakdown is True  # the flops profiler turns timing on
    assert cfg.communication_data_type is torch.bfloat16 and cfg.seq_parallel_communication_data_type is torch.float32
    assert cfg.pipeline == {"stages": "auto", "partition": "best", "seed_layers": False,
                            "activation_checkpoint_interval": 2, "pipe_partitioned": True, "grad_partitioned": True}
    assert cfg.checkpoint_tag_validation_enabled and cfg.checkpoint_tag_validation_fail
    assert not cfg.monitor_config.enabled and cfg.comms_config.comms_logger_enabled is False


def test_attributes_of_a_minimal_config_match_deepspeeds_off_values():
    cfg = DeepSpeedConfig({"train_batch_size": 4})
    assert (cfg.optimizer_name, cfg.optimizer_params, cfg.scheduler_name, cfg.scheduler_params) == (None,) * 4
    assert (cfg.zero_optimization_stage, cfg.zero_enabled, cfg.fp16_enabled, cfg.fp16_auto_cast) == (0, False, False,
                                                                                                     None)
    assert cfg.loss_scale == C.FP16_LOSS_SCALE_DEFAULT and cfg.dynamic_loss_scale_args is None
    assert cfg.initial_dynamic_scale == 2**C.FP16_INITIAL_SCALE_POWER_DEFAULT
    assert cfg.amp_params is False and cfg.torch_autocast_dtype is None and cfg.communication_data_type is None
    assert cfg.checkpoint_tag_validation_enabled and not cfg.checkpoint_tag_validation_fail
    assert cfg.wall_clock_breakdown is False and cfg.gradient_clipping == C.GRADIENT_CLIPPING_DEFAULT
    bf16 = DeepSpeedConfig({"train_batch_size": 4, "bf16": {"enabled": True}})
    assert (bf16.bfloat16_enabled, bf16.loss_scale, bf16.initial_dynamic_scale) == (True, 1.0, 1)
    ignore = DeepSpeedConfig({"train_batch_size": 4, "checkpoint": {"tag_validation": "IGNORE"},
                              "torch_autocast": {"enabled": True, "dtype": "float16"}})
    assert not ignore.checkpoint_tag_validation_enabled and ignore.torch_autocast_dtype is torch.float16


def test_print_logs_every_attribute_and_the_user_config(caplog):
    logger = logging.getLogger("DeepSpeed")  # does not propagate to the root logger: attach caplog's handler
    cfg = DeepSpeedConfig({"train_batch_size": 4000})
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="DeepSpeed"):
            cfg.print("DeepSpeedEngine configuration")
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "DeepSpeedEngine configuration:"
    assert "  train_batch_size ............. 4000" in lines
    assert "  zero_optimization_stage ...... 0" in lines
    assert not any("_param_dict" in line or "typed_config" in line for line in lines)
    assert lines[-1].startswith("  json = ") and "4.000000e+03" in lines[-1]  # ScientificNotationEncoder


def test_deprecated_zero_offload_keys_at_stage_0_warn_and_the_config_builds():
    data = {"train_batch_size": 8, "zero_optimization": {"stage": 0, "cpu_offload": True, "cpu_offload_param": True,
                                                         "cpu_offload_use_pin_memory": True}}
    with pytest.warns(DeprecatedConfigWarning) as record:
        cfg = DeepSpeedConfig(data)
    text = " | ".join(str(w.message) for w in record)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        assert f"'{old}' is deprecated; use '{new}' instead" in text
    assert "'cpu_offload_use_pin_memory' is deprecated" in text
    assert cfg.zero_optimization_stage == 0 and cfg.zero_config.offload_optimizer is None
    with pytest.warns(DeprecatedConfigWarning, match="'cpu_offload' is deprecated; use 'offload_optimizer'"):
        migrated = DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 1, "cpu_offload": True}})
    assert migrated.zero_config.offload_optimizer.device == "cpu"


def test_offload_optimizer_pipeline_property():
    cfg = DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pipeline_read": True}}})
    assert cfg.zero_config.offload_optimizer.pipeline is True
    cfg.zero_config.offload_optimizer.pipeline_read = False
    assert cfg.zero_config.offload_optimizer.pipeline is False


# -------------------------------------------------------------------------------------- module contents

def test_runtime_config_is_a_real_module_that_keeps_ds_config_config_names():
    assert rc is not ds_config.config and rc.DeepSpeedConfig is not ds_config.DeepSpeedConfig
    public = [n for n in vars(ds_config.config)
              if not n.startswith("_") and n not in ("DeepSpeedConfig", "annotations")]
    assert public and all(getattr(rc, n) is getattr(ds_config.config, n) for n in public)
    assert rc.DeepSpeedZeroConfig is ds_config.DeepSpeedZeroConfig  # e.g. the section classes
    assert rc.TRAIN_BATCH_SIZE == "train_batch_size"  # and the key constants, as DeepSpeed star-imports them


def test_optimizer_name_constants():
    names = {"ADAGRAD": "adagrad", "ADAM": "adam", "ADAMW": "adamw", "LAMB": "lamb", "ONEBIT_ADAM": "onebitadam",
             "ZERO_ONE_ADAM": "zerooneadam", "ONEBIT_LAMB": "onebitlamb", "MUADAM": "muadam", "MUADAMW": "muadamw",
             "MUSGD": "musgd", "LION": "lion", "MUON": "muon"}
    assert {k: getattr(rc, f"{k}_OPTIMIZER") for k in names} == names
    assert set(rc.DEEPSPEED_OPTIMIZERS) == set(names.values()) == set(SCHEMA_OPTIMIZERS)
    assert (rc.TORCH_ADAM_PARAM, rc.ADAM_W_MODE, rc.ADAM_W_MODE_DEFAULT) == ("torch_adam", "adam_w_mode", True)
    import deepspeed
    from ds_config import ConfigError

    assert rc.DeepSpeedConfigError is deepspeed.DeepSpeedConfigError is ConfigError


def test_config_writer_round_trip(tmp_path):
    writer = rc.DeepSpeedConfigWriter({"train_batch_size": 8})
    writer.add_config("fp16", {"enabled": True})
    writer.write_config(tmp_path / "out.json")
    again = rc.DeepSpeedConfigWriter()
    again.load_config(tmp_path / "out.json")
    assert again.data == {"train_batch_size": 8, "fp16": {"enabled": True}}
    (tmp_path / "dup.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(ValueError, match="Duplicate keys"):
        again.load_config(tmp_path / "dup.json")


# Every *_DEFAULT of deepspeed.runtime.constants -> where the schema holds that default.
DEFAULT_PATHS = {
    "TRAIN_BATCH_SIZE_DEFAULT": "train_batch_size",
    "GRADIENT_ACCUMULATION_STEPS_DEFAULT": "gradient_accumulation_steps",
    "TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT": "train_micro_batch_size_per_gpu",
    "OPTIMIZER_TYPE_DEFAULT": "optimizer", "SCHEDULER_TYPE_DEFAULT": "scheduler",
    "LEGACY_FUSION_DEFAULT": "<optimizer>.legacy_fusion",
    "ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT": "zero_allow_untested_optimizer",
    "ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT": "zero_force_ds_cpu_optimizer",
    "STEPS_PER_PRINT_DEFAULT": "steps_per_print", "SPARSE_GRADIENTS_DEFAULT": "sparse_gradients",
    "BFLOAT16_ENABLED_DEFAULT": "bf16.enabled", "BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT": "bf16.immediate_grad_update",
    "BFLOAT16_MASTER_WEIGHTS_AND_GRADS_DEFAULT": "bf16.bf16_master_weights_and_grads",
    "BFLOAT16_OPTIMIZER_STATES_DEFAULT": "bf16.bf16_optimizer_states",
    "FP16_ENABLED_DEFAULT": "fp16.enabled", "FP16_LOSS_SCALE_DEFAULT": "fp16.loss_scale",
    "FP16_AUTO_CAST_DEFAULT": "fp16.auto_cast", "FP16_INITIAL_SCALE_POWER_DEFAULT": "fp16.initial_scale_power",
    "FP16_LOSS_SCALE_WINDOW_DEFAULT": "fp16.loss_scale_window", "FP16_HYSTERESIS_DEFAULT": "fp16.hysteresis",
    "FP16_CONSECUTIVE_HYSTERESIS_DEFAULT": "fp16.consecutive_hysteresis",
    "FP16_MIN_LOSS_SCALE_DEFAULT": "fp16.min_loss_scale",
    "FP16_MASTER_WEIGHTS_AND_GRADS_DEFAULT": "fp16.fp16_master_weights_and_grads",
    "AMP_ENABLED_DEFAULT": "amp.enabled", "TORCH_AUTOCAST_ENABLED_DEFAULT": "torch_autocast.enabled",
    "GRADIENT_CLIPPING_DEFAULT": "gradient_clipping",
    "COMMUNICATION_DATA_TYPE_DEFAULT": "communication_data_type",
    "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT": "seq_parallel_communication_data_type",
    "PRESCALE_GRADIENTS_DEFAULT": "prescale_gradients",
    "GRADIENT_PREDIVIDE_FACTOR_DEFAULT": "gradient_predivide_factor",
    "DISABLE_ALLGATHER_DEFAULT": "disable_allgather", "DUMP_STATE_DEFAULT": "dump_state",
    "WALL_CLOCK_BREAKDOWN_DEFAULT": "wall_clock_breakdown", "MEMORY_BREAKDOWN_DEFAULT": "memory_breakdown",
    "PLD_ENABLED_DEFAULT": "progressive_layer_drop.enabled", "PLD_THETA_DEFAULT": "progressive_layer_drop.theta",
    "PLD_GAMMA_DEFAULT": "progressive_layer_drop.gamma",
    "CHECKPOINT_TAG_VALIDATION_DEFAULT": "checkpoint.tag_validation",
    "LOAD_UNIVERSAL_CHECKPOINT_DEFAULT": "checkpoint.load_universal",
    "USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT": "checkpoint.use_node_local_storage",
    "CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT": "checkpoint.parallel_write.pipeline_stage",
    "GRAD_ACCUM_DTYPE_DEFAULT": "data_types.grad_accum_dtype", "LOG_LEVEL_DEFAULT": "log_level",
}
DEFAULT_PATHS.update({f"EIGENVALUE_{k.upper()}_DEFAULT": f"eigenvalue.{k}"
                      for k in ds_config.EigenvalueConfig.model_fields})
DEFAULT_PATHS.update({f"SPARSE_{k.upper()}_DEFAULT": f"<sparse_attention>.{k}"
                      for k in ds_config.SparseAttentionConfig.model_fields})
DEFAULT_PATHS["SPARSE_ATTENTION_TYPE_DEFAULT"] = DEFAULT_PATHS.pop("SPARSE_ATTENTION_DEFAULT")


def _schema_default(path: str):
    defaults = ds_config.DeepSpeedConfig()
    node = defaults
    for part in path.split("."):
        if part == "<optimizer>":
            node = ds_config.OptimizerConfig(type="adam")
        elif part == "<sparse_attention>":
            node = ds_config.SparseAttentionConfig()
        else:
            node = getattr(node, part)
    return node


def test_every_default_constant_is_compared():
    constants = sorted(n for n in vars(C) if n.endswith("_DEFAULT"))
    assert constants == sorted(DEFAULT_PATHS)


@pytest.mark.parametrize("name", sorted(DEFAULT_PATHS))
def test_default_constants_equal_the_schema_defaults(name):
    value, schema = getattr(C, name), _schema_default(DEFAULT_PATHS[name])
    if name == "CHECKPOINT_TAG_VALIDATION_DEFAULT":  # DeepSpeed upper-cases the mode; the schema capitalises it
        assert value == schema.upper() and value in C.CHECKPOINT_TAG_VALIDATION_MODES
        return
    if name == "BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT":  # DeepSpeed 0.19.6 too: a stale True, the schema's False
        assert value is True and schema is False
        return
    assert value == schema, (name, value, schema)
    assert type(value) is type(schema) or {type(value), type(schema)} == {int, float}  # 0 for 0.0, never False


TOP_LEVEL_KEYS = ("TRAIN_BATCH_SIZE", "TRAIN_MICRO_BATCH_SIZE_PER_GPU", "GRADIENT_ACCUMULATION_STEPS", "OPTIMIZER",
                  "SCHEDULER", "ZERO_ALLOW_UNTESTED_OPTIMIZER", "ZERO_FORCE_DS_CPU_OPTIMIZER", "STEPS_PER_PRINT",
                  "SPARSE_GRADIENTS", "BFLOAT16", "BFLOAT16_OLD", "FP16", "AMP", "TORCH_AUTOCAST", "GRADIENT_CLIPPING",
                  "COMMUNICATION_DATA_TYPE", "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE", "PRESCALE_GRADIENTS",
                  "GRADIENT_PREDIVIDE_FACTOR", "DISABLE_ALLGATHER", "DUMP_STATE", "WALL_CLOCK_BREAKDOWN",
                  "MEMORY_BREAKDOWN", "EIGENVALUE", "PROGRESSIVE_LAYER_DROP", "CHECKPOINT", "DATA_TYPES",
                  "SPARSE_ATTENTION")


@pytest.mark.parametrize("name", TOP_LEVEL_KEYS)
def test_top_level_key_constants_are_schema_keys(name):
    assert getattr(C, name) in ds_config.DeepSpeedConfig.known_keys()


def test_section_key_constants_are_section_fields():
    fp16 = [v for n, v in vars(C).items() if n.startswith("FP16_") and not n.endswith("_DEFAULT")]
    bf16 = [v for n, v in vars(C).items() if n.startswith("BFLOAT16_") and n != "BFLOAT16_OLD"
            and not n.endswith("_DEFAULT")]
    ckpt = [C.CHECKPOINT_TAG_VALIDATION, C.LOAD_UNIVERSAL_CHECKPOINT, C.USE_NODE_LOCAL_STORAGE_CHECKPOINT,
            C.CHECKPOINT_PARALLEL_WRITE]
    for keys, model in ((fp16, ds_config.FP16Config), (bf16, ds_config.BF16Config),
                        (ckpt, ds_config.CheckpointConfig)):
        assert keys and all(k in model.model_fields for k in keys), (model, keys)
    assert C.TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES in ds_config.TorchAutocastConfig.model_fields


# ---------------------------------------------------------------------- config_utils and precision_config

def test_config_utils_path_serves_the_same_objects():
    for name in cu.__all__:
        assert getattr(cu, name) is getattr(ds_config.config_utils, name)
    assert cu.get_scalar_param({"a": 1}, "b", 2) == 2


def test_precision_config_maps_to_the_typed_sections():
    assert pc.DeepSpeedFP16Config is ds_config.FP16Config and pc.DeepSpeedBF16Config is ds_config.BF16Config
    fp16 = pc.get_float16_config({"fp16": {"enabled": True, "loss_scale": 128}})
    assert fp16.enabled and fp16.loss_scale == 128 and not fp16.dynamic_loss_scale
    assert pc.get_float16_config({}) == ds_config.FP16Config()
    assert pc.get_bfloat16_config({"bf16": {"enabled": True}}).enabled
    with pytest.warns(DeprecatedConfigWarning, match="'bfloat16' is deprecated; use 'bf16'"):
        assert pc.get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled
    with pytest.raises(ConfigError) as err:
        pc.get_float16_config({"fp16": {"enabled": True, "loss_scal": 1}})
    assert err.value.paths == ["fp16.loss_scal"]
    assert (pc.FP16, pc.BFLOAT16, pc.BFLOAT16_OLD) == (C.FP16, C.BFLOAT16, C.BFLOAT16_OLD)


def test_importing_the_config_modules_does_not_import_torch():
    code = ("import sys, deepspeed.runtime.config, deepspeed.runtime.constants, deepspeed.runtime.config_utils, "
            "deepspeed.runtime.precision_config; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_warnings_for_a_plain_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})

"""Property tests: random invalid configs give a ConfigError that names a key path, never another exception."""

from __future__ import annotations

import copy
import os
import warnings

from _ds_config_testing import key_paths, schema_property_names
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_config import ConfigError, DeepSpeedConfig, UnknownConfigKeyWarning, config_schema, load_config

BASE = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "steps_per_print": 100, "gradient_clipping": 1.0, "prescale_gradients": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "cpu"}},
    "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False},
    "activation_checkpointing": {"partition_activations": True, "number_checkpoints": 4},
    "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": -1},
    "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": ["a"], "partition_type": "row"}]}},
    "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]},
    "checkpoint": {"tag_validation": "Warn", "parallel_write": {"pipeline_stage": True}},
    "elasticity": {"enabled": False, "micro_batch_sizes": [2, 4]},
    "autotuning": {"enabled": False, "tuner_type": "random"},
    "compile": {"deepcompile": False},
    "tensorboard": {"enabled": True, "output_path": "/tmp/tb"},
    "sparse_attention": {"mode": "fixed", "block": 16},
}
OPEN = ("optimizer.params",)  # documented as an open mapping: unknown keys pass through to the constructor
# DS_FUZZ_EXAMPLES=2000 runs a longer search locally; CI keeps the default short.
FAST = settings(max_examples=int(os.environ.get("DS_FUZZ_EXAMPLES", "60")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _dicts(node: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if isinstance(node, dict) else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        out.extend(_dicts(value, prefix + (key,)))
    return out


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _set(config: dict, path: tuple, value: object) -> dict:
    config = copy.deepcopy(config)
    node = config
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return config


def _load(config: dict, strict: bool = True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(config, world_size=4, strict=strict)


def test_base_is_valid():
    assert _load(BASE).batch.train_batch_size == 32


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                 st.text(max_size=6), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@FAST
@given(st.sampled_from(list(key_paths(BASE))), JUNK)
def test_random_values_never_crash(path, junk):
    try:
        _load(_set(BASE, path, junk))
    except ConfigError as err:
        assert err.problems and all(isinstance(p, str) for p in err.paths)
        assert str(err).startswith("Invalid DeepSpeed config")


@FAST
@given(st.sampled_from(list(key_paths(BASE))),
       st.one_of(st.lists(st.fixed_dictionaries({"zz": st.integers()}), min_size=1, max_size=2),
                 st.dictionaries(st.sampled_from(["zz", "qq"]), st.integers(), min_size=1)))
def test_wrong_container_types_fail_at_their_path(path, junk):
    dotted = _dotted(path)
    if dotted.startswith(OPEN) or isinstance(path[-1], int):
        return
    try:
        _load(_set(BASE, path, junk))
    except ConfigError as err:
        assert any(p == dotted or p.startswith(dotted + ".") or p.startswith(dotted + "[") for p in err.paths), \
            (dotted, err.paths)
    else:
        raise AssertionError(f"{dotted}={junk!r} was accepted")


KEY = st.from_regex(r"\A[a-z][a-z_]{2,10}[a-z]\Z")


@FAST
@given(st.sampled_from([d for d in _dicts(BASE) if not _dotted(d).startswith(OPEN)]), KEY)
def test_unknown_keys_at_any_depth(where, key):
    node = BASE
    for part in where:
        node = node[part]
    if key in node:
        return
    config = _set(BASE, where + (key,), 1) if where else {**BASE, key: 1}
    expected = _dotted(where + (key,))
    try:
        _load(config)
    except ConfigError as err:
        assert expected in err.paths, (expected, err.paths)
        assert "unknown key" in str(err)
    else:
        raise AssertionError(f"unknown key {expected} was accepted")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(config, strict=False)
    assert any(issubclass(w.category, UnknownConfigKeyWarning) and expected in str(w.message) for w in caught)


POSITIVE = ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "aio.block_size", "aio.queue_depth",
            "flops_profiler.profile_step", "activation_checkpointing.number_checkpoints", "fp16.hysteresis",
            "scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps", "tensor_parallel.autotp_size",
            "elasticity.micro_batch_sizes[0]"]
NON_NEGATIVE = ["gradient_clipping", "fp16.loss_scale", "optimizer.params.lr", "optimizer.params.weight_decay",
                "fp16.initial_scale_power"]


def _path_of(dotted: str) -> tuple:
    parts: list = []
    for piece in dotted.split("."):
        name, _, index = piece.partition("[")
        parts.append(name)
        if index:
            parts.append(int(index.rstrip("]")))
    return tuple(parts)


@FAST
@given(st.sampled_from(POSITIVE + NON_NEGATIVE), st.data())
def test_out_of_range_numbers_name_their_key(dotted, data):
    upper = 0 if dotted in POSITIVE else -1
    value = data.draw(st.one_of(st.integers(-10**9, upper), st.floats(-1e9, upper - 0.5)))
    if dotted == "tensor_parallel.autotp_size" and value in (0,):
        return  # 0 documents "AutoTP off"
    try:
        _load(_set(BASE, _path_of(dotted), value))
    except ConfigError as err:
        assert dotted in err.paths, (dotted, err.paths)
    else:
        raise AssertionError(f"{dotted}={value!r} was accepted")


def _all_keys() -> list[str]:
    return sorted(k for k in schema_property_names(config_schema()) if not k.startswith("$"))


SECTIONS = sorted(k for k in DeepSpeedConfig.known_keys() if not k.startswith("$"))
# Random nested sections built from real key names (so they reach real fields) and junk values.
SECTION_BODY = st.recursive(
    JUNK, lambda inner: st.dictionaries(st.sampled_from(_all_keys()), inner, max_size=4) | st.lists(inner, max_size=3),
    max_leaves=12)


@FAST
@given(st.dictionaries(st.sampled_from(SECTIONS), SECTION_BODY, min_size=1, max_size=3))
def test_random_sections_never_crash(config):
    try:
        _load(config)
    except ConfigError as err:
        assert err.problems and all(isinstance(p, str) for p in err.paths)

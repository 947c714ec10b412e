"""GPT-NeoX YAML configs: merge them and split them into DeepSpeed config, launcher settings and model arguments.

``load("base.yml", "override.yml")`` reads the files in order (a key in a later file replaces the whole value
of the same key in an earlier one), accepts ``num-layers`` and ``num_layers`` alike, fills in the defaults of
the GPT-NeoX configuration reference and returns a :class:`NeoxConfig`:

- ``deepspeed``: the DeepSpeed config dict, built from the DSC keys (``optimizer``, ``zero_optimization``,
  ``fp16``, ``train_micro_batch_size_per_gpu``, ``gradient_clipping``, ...) with NeoX's documented defaults
  (e.g. ``gradient_clipping`` 0, ``steps_per_print`` 10); keys without a default appear only when given;
- ``launcher``: the DeepSpeed runner settings (hostfile, include, exclude, num_nodes, num_gpus, master_port,
  master_addr, launcher);
- ``model``: every other documented argument (Megatron and NeoX), underscore spelling, defaults filled in
  (None where the reference has none), plus the values of unknown keys.

Unknown keys are listed in ``unknown_keys`` and warned about with a did-you-mean; ``strict=True`` makes them
a ``ConfigError``. PyYAML is imported only when a file is read, so ``import ds_config`` stays light.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_config._base import UnknownConfigKeyWarning
from ds_config._errors import ConfigError, ConfigProblem, did_you_mean
from ds_config._neox_keys import BOOL, DICT, FLOAT, INT, KEYS, LAUNCHER_KEYS, LIST, STR, NeoxKey

__all__ = ["NeoxConfig", "NeoxLauncher", "load", "merge", "pipeline_args"]

_NEOX_CHECKPOINTABLE = ["ParallelTransformerLayerPipe", "GMLPBlock"]

_LOWER = {k.lower(): k for k in KEYS}


@dataclass(frozen=True)
class NeoxLauncher:
    """DeepSpeed runner settings from a NeoX config (the reference's DSL keys)."""

    hostfile: str = "/job/hostfile"
    """MPI-style hostfile listing the resource pool (``worker-0 slots=4``)."""
    include: str | None = None
    """Resources to use, ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC=NAME[:SLOT[,SLOT ...]]``."""
    exclude: str | None = None
    """Resources not to use, same format as ``include``."""
    num_nodes: int = -1
    """Number of nodes (the first N of the hostfile); -1 = all."""
    num_gpus: int = -1
    """GPUs per node (ids 0..N-1); -1 = all."""
    master_port: int = 29500
    """Port of the torch.distributed rendezvous."""
    master_addr: str | None = None
    """Address of node 0; None = inferred by the launcher."""
    launcher: str = "pdsh"
    """Multi-node backend: pdsh, openmpi or mvapich."""


@dataclass
class NeoxConfig:
    """A merged GPT-NeoX config, split by who consumes each key."""

    deepspeed: dict[str, Any]
    """The DeepSpeed config dict (DSC keys)."""
    launcher: NeoxLauncher
    """DeepSpeed runner settings (DSL keys)."""
    model: dict[str, Any]
    """Megatron / NeoX model and training arguments, underscore spelling."""
    unknown_keys: list[str] = field(default_factory=list)
    """Keys the reference does not document (their values are kept in ``model``)."""
    sources: tuple[str, ...] = ()
    """The files merged, in order."""


def load(*yaml_paths: str | os.PathLike[str], strict: bool = False) -> NeoxConfig:
    """Read and merge GPT-NeoX YAML files (later files win); see the module docstring for the result."""
    if not yaml_paths:
        raise ConfigError("give at least one GPT-NeoX YAML file", "neox")
    import yaml  # lazy: PyYAML is only needed here

    configs = []
    for path in yaml_paths:
        configs.append(_read_yaml(yaml, os.fspath(path)))
    return _merge(configs, strict, tuple(os.fspath(p) for p in yaml_paths), stacklevel=4)


def merge(*configs: Mapping[str, Any], strict: bool = False, sources: Sequence[str] = ()) -> NeoxConfig:
    """Merge already-parsed NeoX config mappings (later ones win) and split them like :func:`load`."""
    return _merge(configs, strict, tuple(sources), stacklevel=4)


def pipeline_args(config: NeoxConfig) -> dict[str, Any]:
    """The ``PipelineModule`` keyword arguments GPT-NeoX derives from its config (as its ``GPT2ModelPipe`` does):
    ``num_stages`` (``pipe_parallel_size``; at least 1), ``partition_method`` (``pipe_partition_method``),
    ``activation_checkpoint_interval`` (``checkpoint_num_layers`` when ``checkpoint_activations``, else 0),
    ``checkpointable_layers`` (NeoX's transformer and gMLP layer classes) and ``base_seed`` (``seed``)."""
    model = config.model
    return {"num_stages": max(int(model["pipe_parallel_size"]), 1),
            "partition_method": model["pipe_partition_method"],
            "activation_checkpoint_interval": int(model["checkpoint_num_layers"]) if model["checkpoint_activations"]
            else 0,
            "checkpointable_layers": list(_NEOX_CHECKPOINTABLE),
            "base_seed": int(model["seed"])}


def _merge(configs: Sequence[Mapping[str, Any]], strict: bool, sources: tuple[str, ...],
           stacklevel: int) -> NeoxConfig:
    """``stacklevel``: frames from the unknown-key warning up to the caller of the public function."""
    names = (list(sources) + [f"<config {i}>" for i in range(len(sources), len(configs))])[: len(configs)]
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, config in zip(names, configs, strict=True):
        for key, value in _canonical_keys(config, name).items():
            merged[key] = value
            origin[key] = name
    unknown = [k for k in merged if k not in KEYS]
    _report_unknown(unknown, origin, strict, stacklevel)
    values = _typed_values(merged, origin)
    _derive(values)
    _check(values)
    return _split(values, merged, unknown, tuple(names[: len(sources)]))


def _read_yaml(yaml: Any, path: str) -> Mapping[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read GPT-NeoX config: {exc.strerror}", path) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", path) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"a GPT-NeoX config must be a mapping of keys to values, got {type(data).__name__}", path)
    return data


def _canonical(key: str) -> str:
    """Underscore spelling of a key; documented keys also match case-insensitively (``ddp-impl``)."""
    under = key.replace("-", "_")
    return under if under in KEYS else _LOWER.get(under.lower(), under)


def _canonical_keys(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in config.items():
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings (in {source})", str(key), key)
        canon = _canonical(key)
        if canon in out:
            raise ConfigError(f"'{spelled[canon]}' and '{key}' are the same key (hyphens and underscores are "
                              f"interchangeable); give it once (in {source})", canon)
        out[canon] = value
        spelled[canon] = key
    return out


def _report_unknown(unknown: list[str], origin: dict[str, str], strict: bool, stacklevel: int) -> None:
    if not unknown:
        return
    known = list(KEYS)
    problems = [ConfigProblem(k, f"unknown GPT-NeoX key (in {origin[k]}){did_you_mean(k, known)}") for k in unknown]
    if strict:
        raise ConfigError(problems)
    for problem in problems:
        warnings.warn(f"{problem}; kept, unchecked, in the model arguments", UnknownConfigKeyWarning,
                      stacklevel=stacklevel)


def _typed_values(merged: dict[str, Any], origin: dict[str, str]) -> dict[str, Any]:
    """Every documented key -> its checked value, or its default when absent (or null)."""
    values: dict[str, Any] = {}
    problems: list[ConfigProblem] = []
    for name, spec in KEYS.items():
        value = merged.get(name)
        if value is None:
            values[name] = list(spec.default) if spec.kind == LIST else spec.default
            continue
        try:
            values[name] = _coerce(spec, value)
        except ValueError as exc:
            problems.append(ConfigProblem(name, f"{exc} (in {origin[name]})", value))
    if problems:
        raise ConfigError(problems)
    return values


def _coerce(spec: NeoxKey, value: Any) -> Any:
    kind = spec.kind
    if isinstance(kind, tuple):
        if isinstance(value, str) and value.lower() in kind:
            return value.lower()
        raise ValueError(f"expected one of {', '.join(kind)}")
    if kind == BOOL and isinstance(value, bool):
        return value
    if kind == INT and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == FLOAT:
        return _as_float(value)
    if kind == STR and isinstance(value, str):
        return value
    if kind == DICT and isinstance(value, Mapping):
        return dict(value)
    if kind == LIST and isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"expected {_KIND_WORDS[kind]}")


_KIND_WORDS = {BOOL: "true or false", INT: "an integer", FLOAT: "a number", STR: "a string",
               DICT: "a mapping (dictionary)", LIST: "a list"}


def _as_float(value: Any) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):  # PyYAML reads 1e-05 (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None or not math.isfinite(number):
        raise ValueError("expected a finite number")
    return number


def _derive(values: dict[str, Any]) -> None:
    """The reference's documented implications between keys."""
    if values["lr_decay_iters"] is None:
        values["lr_decay_iters"] = values["train_iters"]  # "If None defaults to --train-iters"
    if values["apply_query_key_layer_scaling"]:
        values["attention_softmax_in_fp32"] = True  # "will automatically set attention-softmax-in-fp32"
    if values["lazy_mpu_init"]:
        values["use_cpu_initialization"] = True  # "Also turns on use-cpu-initialization"


def _check(values: dict[str, Any]) -> None:
    """Ranges and relations the reference states; every problem is reported at once."""
    problems: list[ConfigProblem] = []

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            problems.append(ConfigProblem(key, message, values[key]))

    for key in ("num_layers", "num_unique_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                "seq_length", "batch_size", "train_iters", "model_parallel_size", "make_vocab_size_divisible_by",
                "checkpoint_num_layers", "train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "steps_per_print"):
        need(values[key] is None or values[key] >= 1, key, "must be >= 1")
    need(values["pipe_parallel_size"] >= 0, "pipe_parallel_size", "must be >= 0 (0 disables pipeline parallelism)")
    for key in ("num_nodes", "num_gpus"):
        need(values[key] == -1 or values[key] >= 1, key, "must be -1 (all) or >= 1")
    need(1 <= values["master_port"] <= 65535, "master_port", "must be a TCP port, 1..65535")
    for key in ("attention_dropout", "hidden_dropout", "mask_prob", "short_seq_prob", "query_in_block_prob", "warmup"):
        need(0.0 <= values[key] <= 1.0, key, "must be within 0..1")
    need(values["gradient_clipping"] >= 0.0, "gradient_clipping", "must be >= 0 (0 disables clipping)")
    layers, unique = values["num_layers"], values["num_unique_layers"]
    if layers is not None and unique is not None:
        need(layers % unique == 0, "num_unique_layers", f"num_layers ({layers}) must be divisible by it")
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if hidden is not None and heads is not None and heads >= 1:
        need(hidden % heads == 0, "num_attention_heads", f"hidden_size ({hidden}) must be divisible by it")
    need(_is_split(values["split"]), "split", "expected comma-separated non-negative numbers, e.g. '969, 30, 1'")
    if problems:
        raise ConfigError(problems)


def _is_split(text: str) -> bool:
    try:
        parts = [float(p) for p in text.split(",")]
    except ValueError:
        return False
    return all(p >= 0 for p in parts) and sum(parts) > 0


def _split(values: dict[str, Any], merged: dict[str, Any], unknown: list[str],
           sources: tuple[str, ...]) -> NeoxConfig:
    deepspeed = {k: v for k, v in values.items() if KEYS[k].origin == "DSC" and v is not None}
    launcher = NeoxLauncher(**{k: values[k] for k in LAUNCHER_KEYS})
    model = {k: v for k, v in values.items() if KEYS[k].origin in ("Meg", "NeoX")}
    model.update({k: merged[k] for k in unknown})
    return NeoxConfig(deepspeed=deepspeed, launcher=launcher, model=model, unknown_keys=unknown, sources=sources)

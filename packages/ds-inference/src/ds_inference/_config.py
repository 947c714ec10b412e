"""Merge ``init_inference``'s ``config`` (dict or JSON path) with its keyword arguments into the typed config.

``InferenceConfig`` is the engine's view of ``DeepSpeedInferenceConfig``: the same fields, but ``dtype`` is a
``torch.dtype`` (as DeepSpeed documents it: scripts test ``engine._config.dtype == torch.half``); ds_config keeps
a string enum there because it must not import torch.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from pydantic import field_validator

from ds_config import ConfigError, validate_section
from ds_config.inference import DeepSpeedInferenceConfig, DtypeEnum


class InferenceConfig(DeepSpeedInferenceConfig):
    """``DeepSpeedInferenceConfig`` with ``dtype`` as a ``torch.dtype`` (default ``torch.float16``)."""

    dtype: Any = torch.float16
    """Model data type: torch.float16, torch.bfloat16, torch.float32 or torch.int8 (any DtypeEnum spelling)."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> torch.dtype:  # same name: replaces the string-enum validator
        return getattr(torch, DtypeEnum.parse(value).torch_name)

    @classmethod
    def of(cls, config: DeepSpeedInferenceConfig) -> InferenceConfig:
        """The engine view of an already validated config (no re-validation, no repeated warnings)."""
        if isinstance(config, cls):
            return config
        values = {name: getattr(config, name) for name in DeepSpeedInferenceConfig.model_fields}
        values["dtype"] = cls._dtype(config.dtype)
        return cls.model_construct(_fields_set=set(config.model_fields_set), **values)


def _same(key: str, a: Any, b: Any) -> bool:
    """Whether two spellings of one key ask for the same thing (``"fp16"`` and ``torch.half`` do)."""
    if a is b:
        return True
    if key == "dtype":
        try:
            return DtypeEnum.parse(a) == DtypeEnum.parse(b)
        except ValueError:
            return False
    try:
        equal = a == b
    except Exception:  # noqa: BLE001 - objects whose == raises (tensors of different shapes) are different
        return False
    return equal if isinstance(equal, bool) else False


def _read(config: str | os.PathLike | dict[str, Any] | DeepSpeedInferenceConfig | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, DeepSpeedInferenceConfig):
        return dict(config.model_dump(exclude_unset=True, by_alias=False))
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as handle:
                data = json.load(handle)
        except OSError as exc:
            raise ValueError(f"config: cannot read the inference config JSON {os.fspath(config)!r}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"config: {os.fspath(config)!r} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"config: {os.fspath(config)!r} must hold a JSON object, got {type(data).__name__}")
        return data
    if isinstance(config, dict):
        return dict(config)
    raise TypeError(f"config: expected a dict, a path to a JSON file or None, got {type(config).__name__}")


def _field_names() -> dict[str, str]:
    """Every input spelling of a top-level key (name and alias) -> the field name."""
    out = {}
    for name, field in DeepSpeedInferenceConfig.model_fields.items():
        out[name] = name
        if field.alias:
            out[field.alias] = name
    return out


def build_config(config: Any = None, **kwargs: Any) -> InferenceConfig:
    """The typed config from ``config`` and ``kwargs``; a key given in both with different values is an error
    (also when the two use different spellings of it, e.g. ``max_tokens`` and ``max_out_tokens``)."""
    data = _read(config)
    fields = _field_names()
    for key in sorted(kwargs):
        field = fields.get(key)
        for other in [k for k in data if k == key or (field is not None and fields.get(k) == field)]:
            if not _same(field or key, data[other], kwargs[key]):
                theirs = "kwargs" if other == key else f"'{key}' in kwargs"
                raise ConfigError(f"conflicting argument '{other}' in 'config': {data[other]!r} and {theirs}: "
                                  f"{kwargs[key]!r}; give it once, or the same value in both", path=key)
            del data[other]  # the same value twice: keep the keyword argument's spelling
    data.update(kwargs)
    return validate_section(InferenceConfig, data)


def default_inference_config() -> dict[str, Any]:
    """The default inference configuration as a dictionary (every documented field at its default; ``dtype`` is
    ``torch.float16``, as in DeepSpeed)."""
    return InferenceConfig().model_dump()

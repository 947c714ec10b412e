"""Merge ``init_inference``'s ``config`` (dict or JSON path) with its keyword arguments into the typed config."""

from __future__ import annotations

import json
import os
from typing import Any

from ds_config import ConfigError, validate_section
from ds_config.inference import DeepSpeedInferenceConfig, DtypeEnum


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


def build_config(config: Any = None, **kwargs: Any) -> DeepSpeedInferenceConfig:
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
    return validate_section(DeepSpeedInferenceConfig, data)


def default_inference_config() -> dict[str, Any]:
    """The default inference configuration as a dictionary (every documented field at its default)."""
    return DeepSpeedInferenceConfig().model_dump()

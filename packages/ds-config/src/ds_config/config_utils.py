"""DeepSpeed's config utilities (``deepspeed.runtime.config_utils``), without torch.

``DeepSpeedConfigModel`` is the base DeepSpeed gives its own config models and the one third-party packages
subclass for theirs: a pydantic model that forbids unknown keys, ignores ``"auto"`` values (Hugging Face
writes them), and moves a deprecated field, declared with ``json_schema_extra={"deprecated": True,
"new_param": ...}``, over to its replacement with a warning. It builds on ``DSConfigModel``, so an unknown key
gets the same did-you-mean error as every section of ``ds_config``.
"""

from __future__ import annotations

import collections
import json
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import reduce
from typing import Any

from pydantic import BaseModel, ConfigDict

from ds_config._base import AUTO, DeprecatedConfigWarning, DSConfigModel

__all__ = [
    "DeepSpeedConfigModel",
    "DeepSpeedConfigObject",
    "ScientificNotationEncoder",
    "dict_raise_error_on_duplicate_keys",
    "get_config_default",
    "get_dict_param",
    "get_list_param",
    "get_scalar_param",
    "pp_int",
]


class DeepSpeedConfigModel(DSConfigModel):
    """Base of DeepSpeed-style config models.

    A deprecated field is declared as ``old: int = Field(0, json_schema_extra={"deprecated": True, ...})`` with
    the optional keys ``new_param`` (the replacing field, dotted for a nested one), ``new_param_fn`` (maps the
    old value to the new one), ``set_new_param`` (``False``: warn only) and ``deprecated_msg``. When the old field
    is given, a ``DeprecatedConfigWarning`` names the replacement and the value moves over; giving both is an
    error. ``"auto"`` means the field's default (DeepSpeed drops it before validation unless ``strict=True``;
    here it means the default either way, as in every ``ds_config`` section; ``strict`` is accepted for the
    signature).
    """

    model_config = ConfigDict(validate_default=True, use_enum_values=True, arbitrary_types_allowed=True)

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:  # Hugging Face writes "auto" for values it fills in later
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == AUTO) or k == "replace_method"}
        super().__init__(**data)
        self._deprecated_fields_check()

    def _deprecated_fields_check(self) -> None:
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False) and name in self.model_fields_set:
                self._process_deprecated_field(name, extra)

    def _process_deprecated_field(self, name: str, extra: Mapping[str, Any]) -> None:
        new = str(extra.get("new_param", "") or "")
        note = str(extra.get("deprecated_msg", "") or "")
        warnings.warn(f"Config parameter {name} is deprecated" + (f" use {new} instead" if new else "")
                      + (f". {note}" if note else ""), DeprecatedConfigWarning, stacklevel=4)
        if not new or not extra.get("set_new_param", True):
            return
        convert: Callable[[Any], Any] = extra.get("new_param_fn") or (lambda value: value)
        value = convert(getattr(self, name))
        *parents, leaf = new.split(".")
        target: BaseModel = reduce(getattr, parents, self)
        if leaf in target.model_fields_set:
            raise DeprecatedParameterConflict(f"Cannot provide deprecated parameter '{name}' and replacing "
                                              f"parameter '{new}' together")
        # the old field goes back to its default (its value has moved), then the new one is set and validated
        self.__dict__[name] = type(self).model_fields[name].get_default(call_default_factory=True)
        self.model_fields_set.discard(name)
        setattr(target, leaf, value)


class DeprecatedParameterConflict(ValueError, AssertionError):
    """A deprecated field and the field replacing it were both given. A ``ValueError`` like every config error
    here, and also the ``AssertionError`` DeepSpeed's base class raises, which its callers catch."""


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    """The default value of ``field_name`` of a config model; ``ValueError`` for an unknown or required field."""
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    if field_name not in fields:
        raise ValueError(f"'{field_name}' is not a field in {config}")
    if fields[field_name].is_required():
        raise ValueError(f"'{field_name}' is a required field and does not have a default value")
    return fields[field_name].get_default(call_default_factory=True)


class pp_int(int):  # noqa: N801 -- DeepSpeed's name
    """An int that prints with thousands separators (``pp_int(1e5)`` shows ``100,000``) or a given text, for
    generated documentation of defaults."""

    custom_print_str: str | None

    def __new__(cls, val: float, custom_print_str: str | None = None) -> pp_int:
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str if getattr(self, "custom_print_str", None) else f"{int(self):,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """``json.dumps(..., cls=ScientificNotationEncoder)``: numbers above 1e3 in scientific notation (``5.000000e+08``)
    so big bucket sizes stay readable in config printouts; everything else as usual."""

    def iterencode(self, o: Any, _one_shot: bool = False, level: int = 0) -> Any:
        indent = self.indent if isinstance(self.indent, int) else 4
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, (int, float)):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, Mapping):
            inner, outer = " " * (level + 1) * indent, " " * level * indent
            items = [f'\n{inner}"{k}": {self.iterencode(v, level=level + 1)}' for k, v in o.items()]
            return "{" + ", ".join(items) + f"\n{outer}" + "}"
        if isinstance(o, Sequence) and not isinstance(o, (str, bytes)):
            return "[" + ", ".join(self.iterencode(v, level=level) for v in o) + "]"
        return "\n, ".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """Base of plain config objects: ``repr()`` is the instance's attributes as sorted JSON."""

    def repr(self) -> dict[str, Any]:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def get_scalar_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when absent."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
    """``object_pairs_hook`` for ``json.load``: a key given twice in one object is a ``ValueError``."""
    pairs = list(ordered_pairs)
    counts = collections.Counter(key for key, _ in pairs)
    duplicated = [key for key, n in counts.items() if n > 1]
    if duplicated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {duplicated}")
    return dict(pairs)

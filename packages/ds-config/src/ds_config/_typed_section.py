"""Shared pieces of the zero, inference and monitor sections: a base model and number/bool types.

``SectionModel`` adds two things to ``DSConfigModel``'s input screening, both about deprecated keys:
a deprecated key holding its default value is dropped (dumps and old templates write ``"cpu_offload": null``,
``"mp_size": 1``), and a deprecated key given together with an alias spelling of its replacement is a
conflict (pydantic would let the alias win and drop the migrated value without a word).
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictBool, ValidationInfo, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from ds_config._base import Deprecated, DSConfigModel, is_own_state


class SectionModel(DSConfigModel):
    """``DSConfigModel`` with the deprecated-key screening described in the module docstring."""

    @model_validator(mode="before")
    @classmethod
    def _screen_input(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and not is_own_state(cls, data, info):
            data = _drop_idle_deprecated(cls, data)
            _reject_alias_target(cls, data)
        return super()._screen_input(data, info)


def deprecated_field(default: Any = None, **kwargs: Any) -> Any:
    """``Field`` of a deprecated key: left out of dumps (its value has moved) and flagged in the JSON Schema."""
    return Field(default, exclude=True, json_schema_extra={"deprecated": True}, **kwargs)


def _deprecation(field: FieldInfo) -> Deprecated | None:
    return next((m for m in field.metadata if isinstance(m, Deprecated)), None)


def _drop_idle_deprecated(cls: type[DSConfigModel], data: dict) -> dict:
    """A deprecated key holding its default value asks for nothing (dumps of older configs write e.g.
    ``"cpu_offload": null`` or ``"mp_size": 1``): drop it rather than let it clash with its replacement."""
    idle = [key for name, field in cls.model_fields.items() if _deprecation(field) is not None
            for key in _spellings(name, field)
            if key in data and not field.is_required()
            and _is_default(data[key], field.get_default(call_default_factory=True))]
    return {k: v for k, v in data.items() if k not in idle} if idle else data


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(default, Enum):
        return isinstance(value, str) and value == default.value
    # only plain JSON values: == on arbitrary objects (tensors, process groups) is not a safe question
    plain = (bool, int, float, str, list, type(None))
    return type(value) in plain and type(value) is type(default) and value == default


def _reject_alias_target(cls: type[DSConfigModel], data: dict) -> None:
    """A deprecated key moves to its replacement's field name; pydantic would let an alias spelling of that
    same field win silently, so both together are a conflict the user must resolve."""
    for name, field in cls.model_fields.items():
        dep = _deprecation(field)
        if dep is None or dep.new is None or not any(k in data for k in _spellings(name, field)):
            continue
        head, _, rest = dep.new.partition(".")
        target = cls.model_fields.get(head)
        if target is None:
            continue
        used = [k for k in _spellings(head, target) if k != head and k in data]
        if used:
            old = next(k for k in _spellings(name, field) if k in data)
            new = ".".join([used[0], rest]) if rest else used[0]
            raise PydanticCustomError(
                "deprecated_conflict",
                "'{old}' is deprecated and '{new}' replaces it: give only '{new}'",
                {"old": old, "new": new},
            )


def _spellings(name: str, field: FieldInfo) -> list[str]:
    return [name] + [a for a in (field.alias, field.validation_alias) if isinstance(a, str) and a != name]


def _no_bool(value: Any) -> Any:
    # pydantic's lax mode reads true/false as 1/0; for a count or a size that is always a mistake
    if isinstance(value, bool):
        raise PydanticCustomError("int_not_bool", "expected an integer, not a boolean")
    return value


def _no_bool_float(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("float_not_bool", "expected a number, not a boolean")
    return value


Bool = StrictBool  # JSON true/false only: "yes" or 1 for a switch is more likely a slip than a choice

# Integral floats (JSON writes 5e8) are accepted by pydantic's lax int; fractional ones are rejected.
Int = Annotated[int, BeforeValidator(_no_bool)]
NonNegInt = Annotated[int, BeforeValidator(_no_bool), Field(ge=0)]
PosInt = Annotated[int, BeforeValidator(_no_bool), Field(ge=1)]
Fraction = Annotated[float, BeforeValidator(_no_bool_float), Field(ge=0.0, le=1.0)]

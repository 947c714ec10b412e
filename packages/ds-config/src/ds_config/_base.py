"""Base model for every config section.

What it adds over a plain pydantic model, once for all sections:
- unknown keys are errors with a did-you-mean (or, with ``strict=False``, warnings and dropped);
- ``"auto"`` (written by Hugging Face Transformers/Accelerate) means the documented default, unless the
  field is marked ``KeepAuto`` because a later stage (the engine, the HF integration) resolves it;
- deprecated names are accepted with a warning naming the replacement, and their value moves over;
- pydantic's ``ValidationError`` becomes a ``ConfigError`` whose problems carry the full dotted key path.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar, get_args, get_origin

from pydantic import AliasChoices, BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from ds_config._errors import _MISSING as _NO_VALUE
from ds_config._errors import ConfigError, ConfigProblem, did_you_mean, join_path

AUTO = "auto"
M = TypeVar("M", bound=BaseModel)


class DeprecatedConfigWarning(FutureWarning):
    """A deprecated config key was used; the message names its replacement."""


class UnknownConfigKeyWarning(UserWarning):
    """An unknown config key was dropped because the config was parsed with ``strict=False``."""


class KeepAuto:
    """Marker (``Annotated[int | Literal["auto"], KeepAuto()]``): the field keeps the literal ``"auto"``.

    Used for values a later stage fills in (batch sizes, optimizer/scheduler params); everywhere else
    ``"auto"`` means the documented default.
    """

    def __repr__(self) -> str:
        return "KeepAuto()"


@dataclass(frozen=True)
class Deprecated:
    """Marker for a deprecated key (``Annotated[bool, Deprecated(new="offload_optimizer", convert=...)]``).

    ``new`` is the replacing key (dotted for a nested key, relative to this section), ``convert`` maps the
    old value to the new key's value. When both the old and the new key are given, that is an error.
    """

    new: str | None = None
    convert: Callable[[Any], Any] | None = None
    note: str = ""


def _marker(field: FieldInfo, kind: type) -> Any:
    """The first ``kind`` marker on the field, also inside ``Annotated`` members of a union (``X | None``)."""
    found = next((m for m in field.metadata if isinstance(m, kind)), None)
    return found if found is not None else _marker_in(field.annotation, kind)


def _marker_in(annotation: Any, kind: type) -> Any:
    if get_origin(annotation) is Annotated:
        found = next((m for m in annotation.__metadata__ if isinstance(m, kind)), None)
        if found is not None:
            return found
    for arg in get_args(annotation):
        found = _marker_in(arg, kind)
        if found is not None:
            return found
    return None


def keeps_auto(field: FieldInfo) -> bool:
    """Whether ``"auto"`` stays as written in this field (``KeepAuto``) instead of meaning the default."""
    return _marker(field, KeepAuto) is not None


def _input_keys(name: str, field: FieldInfo) -> list[str]:
    keys = [name]
    for alias in (field.alias, field.validation_alias):
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
        for choice in choices:
            if isinstance(choice, str) and choice not in keys:
                keys.append(choice)
    return keys


class DSConfigModel(BaseModel):
    """Base of every DeepSpeed config section."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        validate_assignment=True,
        protected_namespaces=(),
        use_attribute_docstrings=True,
    )

    _key_index: ClassVar[dict[type, dict[str, str]]] = {}

    @classmethod
    def known_keys(cls) -> dict[str, str]:
        """Every accepted input key (field names and aliases) -> field name."""
        index = DSConfigModel._key_index.get(cls)
        if index is None:
            index = {key: name for name, f in cls.model_fields.items() for key in _input_keys(name, f)}
            DSConfigModel._key_index[cls] = index
        return index

    @classmethod
    def _renamed_keys(cls) -> dict[str, str]:
        """Deprecated input key -> the key that replaces it (so a suggestion can point past the old name)."""
        out = {}
        for name, field in cls.model_fields.items():
            dep = _marker(field, Deprecated)
            if dep is not None and dep.new:
                out.update({key: dep.new for key in _input_keys(name, field)})
        return out

    @model_validator(mode="before")
    @classmethod
    def _screen_input(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or is_own_state(cls, data, info):
            return data
        known = cls.known_keys()
        open_model = cls.model_config.get("extra") == "allow"  # open mappings (optimizer params, ...)
        unknown = [] if open_model else [k for k in data if k not in known]
        if unknown:
            details = "; ".join(f"'{k}'{did_you_mean(str(k), known)}" for k in unknown)
            raise PydanticCustomError(
                "unknown_key",
                "unknown key {details}; accepted keys: {accepted}",
                {"details": details, "accepted": ", ".join(sorted(known)), "unknown": unknown,
                 "renamed": cls._renamed_keys()},
            )
        _refuse_two_spellings(cls, data)
        data = dict(data)
        for name, field in cls.model_fields.items():
            for key in _input_keys(name, field):
                if key not in data:
                    continue
                if _is_auto(data[key]) and _marker(field, KeepAuto) is None:
                    del data[key]  # "auto" inside a section means the documented default
                elif (dep := _marker(field, Deprecated)) is not None:
                    _migrate(data, key, dep)
        return data


def _refuse_two_spellings(cls: type[BaseModel], data: dict) -> None:
    """One key given by its name and its alias (``max_tokens`` and ``max_out_tokens``): pydantic would keep one
    and call the other unknown, so say what really happened."""
    for name, field in cls.model_fields.items():
        given = [key for key in _input_keys(name, field) if key in data]
        if len(given) > 1:
            raise PydanticCustomError(
                "duplicate_key",
                "given twice, as {spellings} (spellings of one key): give it once",
                {"spellings": " and ".join(f"'{k}'" for k in given), "field": given[-1]},
            )


def is_own_state(cls: type[BaseModel], data: dict, info: ValidationInfo) -> bool:
    """True when pydantic re-validates the model's own state on attribute assignment (``validate_assignment``).

    That state is already screened and holds every field (deprecated ones included), so it must not be
    screened again. ``info.field_name`` alone does not tell: it is also set when the section is validated as a
    field of its parent.
    """
    if info.field_name is None or not all(name in data for name in cls.model_fields):
        return False
    if cls.model_config.get("extra") != "allow" and len(data) != len(cls.model_fields):
        return False  # an extra key: this is user input
    # user input could name every field; the model's own state never holds an "auto" it would replace
    return not any(_is_auto(data[name]) and not keeps_auto(field) for name, field in cls.model_fields.items())


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _migrate(data: dict, key: str, dep: Deprecated) -> None:
    hint = f"; use '{dep.new}' instead" if dep.new else ""
    warnings.warn(f"config key '{key}' is deprecated{hint}{'. ' + dep.note if dep.note else ''}",
                  DeprecatedConfigWarning, stacklevel=2)
    if dep.new is None:
        return
    *parents, leaf = dep.new.split(".")
    target = data
    for part in parents:
        nested = target.get(part)
        nested = dict(nested) if isinstance(nested, dict) else {}
        target[part] = nested
        target = nested
    if leaf in target:
        raise PydanticCustomError(
            "deprecated_conflict",
            "'{old}' is deprecated and '{new}' replaces it: give only '{new}'",
            {"old": key, "new": dep.new},
        )
    target[leaf] = dep.convert(data[key]) if dep.convert else data[key]


def validate_section(cls: type[M], data: Any, *, strict: bool = True, path: str = "") -> M:
    """Validate ``data`` as ``cls``; raise ``ConfigError`` with full key paths.

    Every problem is reported at once: unknown keys are set aside and the rest validated again, so a typo
    does not hide a real error elsewhere. With ``strict=False`` unknown keys are dropped with an
    ``UnknownConfigKeyWarning`` naming their path.
    """
    data = {} if data is None else data
    problems: list[ConfigProblem] = []
    for _ in range(64):  # each round sets aside at least one unknown key
        try:
            result = cls.model_validate(data)
        except ValidationError as exc:
            error = config_error_from(exc, data, path)
            unknown = [e for e in exc.errors() if e["type"] in ("unknown_key", "extra_forbidden")]
            if not unknown or len(unknown) != len(exc.errors()):
                raise (type(error) if not problems else ConfigError)(problems + error.problems) from None
            if strict:
                problems += error.problems
            data = _drop_unknown(data, unknown, path, warn=not strict)
            continue
        if problems:
            raise ConfigError(problems)
        return result
    raise ConfigError(problems or [ConfigProblem(path, "too many unknown keys")])


def _drop_unknown(data: Any, unknown: list[dict], path: str, *, warn: bool) -> Any:
    """A copy of ``data`` without the unknown keys; only the containers on their paths are copied
    (a config may hold objects that cannot be deep-copied, such as process groups)."""
    for e in unknown:
        loc, keys = (e["loc"], e["ctx"]["unknown"]) if e["type"] == "unknown_key" else (e["loc"][:-1], [e["loc"][-1]])
        loc = _clean_loc(loc, data)
        data = _copy_along(data, loc)
        parent = _follow(data, tuple(loc))
        for key in keys:
            if warn:
                hint = did_you_mean(str(key), _known_at(e)) if e["type"] == "unknown_key" else ""
                warnings.warn(f"ignoring unknown config key '{join_path(path, *loc, key)}'{hint}",
                              UnknownConfigKeyWarning, stacklevel=3)
            parent.pop(key, None)
    return data


def _copy_along(data: Any, loc: list) -> Any:
    root = copy.copy(data)
    node = root
    for part in loc:
        node[part] = copy.copy(node[part])
        node = node[part]
    return root


def config_error_from(exc: ValidationError, data: Any, path: str = "") -> ConfigError:
    """Turn pydantic's errors into ``ConfigError`` problems keyed by the path as the user wrote it."""
    merged: dict[str, list[str]] = {}
    values: dict[str, Any] = {}
    kinds: set[type[ConfigError]] = set()  # the classes of the checks' own errors (ElasticityConfigError, ...)
    for err in exc.errors():
        loc = _clean_loc(err["loc"], data)
        if err["type"] == "missing" and err["loc"] and isinstance(err["loc"][-1], str):
            loc = _clean_loc(err["loc"][:-1], data) + [err["loc"][-1]]  # the missing key is not in the input
        if err["type"] == "unknown_key":
            for key in err["ctx"]["unknown"]:
                p = join_path(path, *loc, key)
                merged.setdefault(p, []).append(_unknown_key_message(str(key), _known_at(err),
                                                                     err["ctx"].get("renamed", {})))
            continue
        if err["type"] == "duplicate_key":
            merged.setdefault(join_path(path, *loc, err["ctx"]["field"]), []).append(err["msg"])
            continue
        nested = (err.get("ctx") or {}).get("error")
        if isinstance(nested, ConfigError):  # a cross-field check that already names its key paths
            kinds.add(type(nested))
            for prob in nested.problems:
                merged.setdefault(join_path(path, *loc, prob.path), []).append(prob.message)
                if prob.value is not _NO_VALUE:
                    values.setdefault(join_path(path, *loc, prob.path), prob.value)
            continue
        kinds.add(ConfigError)
        p = join_path(path, *loc)
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if err["type"] == "extra_forbidden":  # a section that skipped the screening: same wording
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "is required but missing"
        if msg not in merged.setdefault(p, []):
            merged[p].append(msg)
        if err["type"] not in ("missing", "deprecated_conflict"):
            values.setdefault(p, err.get("input"))
    problems = [ConfigProblem(p, _readable(msgs), *([values[p]] if p in values else []))
                for p, msgs in merged.items()]
    # one kind of error keeps its class, so callers can catch the subclass DeepSpeed raises there
    return (kinds.pop() if len(kinds) == 1 else ConfigError)(problems)


_SHOULD_BE = "Input should be "
_PLAIN = {"a valid boolean": "a boolean (true or false)", "a valid integer": "an integer", "a valid number": "a number",
          "a valid list": "a list", "a valid string": "a string",
          "a valid integer, got a number with a fractional part": "a whole number (not fractional)"}


def _readable(messages: list[str]) -> str:
    """One sentence from pydantic's per-branch messages: ``must be a number, a list or 'auto'`` instead of
    ``Input should be a valid number, unable to parse string as a number or Input should be ...``."""
    if len(messages) < 2 and not (messages and messages[0].startswith(_SHOULD_BE)):
        return " or ".join(messages)
    parts: list[str] = []
    for msg in messages:
        if not msg.startswith(_SHOULD_BE):
            parts.append(msg)
            continue
        what = msg.removeprefix(_SHOULD_BE).split(", unable to")[0]
        what = re.sub(r"^a valid dictionary( or instance of \w+)?$", "an object (a JSON {...} section)", what)
        what = _PLAIN.get(what, what)
        if what not in parts:
            parts.append(what)
    if all(m.startswith(_SHOULD_BE) for m in messages):
        head = parts[:-1]
        return "must be " + (f"{', '.join(head)} or {parts[-1]}" if head else parts[0])
    return " or ".join(parts)


def _unknown_key_message(key: str, known: list[str], renamed: dict[str, str] | None = None, shown: int = 12) -> str:
    hint = did_you_mean(key, known)
    if hint:
        close = hint.split("'")[1]
        if renamed and close in renamed:  # do not steer the user to a deprecated name
            return f"unknown key{hint[:-1]} It is deprecated: use '{renamed[close]}')"
        return f"unknown key{hint}"
    listed = ", ".join(known[:shown]) + (f", ... ({len(known)} in all)" if len(known) > shown else "")
    return f"unknown key; accepted here: {listed}"


def _known_at(err: dict) -> list[str]:
    return err["ctx"]["accepted"].split(", ")


def _clean_loc(loc: tuple, data: Any) -> list:
    """Keep only the loc parts that are keys/indices of the input (pydantic adds union-branch tags)."""
    out, node = [], data
    for part in loc:
        if isinstance(node, dict) and part in node:
            out.append(part)
            node = node[part]
        elif isinstance(node, (list, tuple)) and isinstance(part, int) and 0 <= part < len(node):
            out.append(part)
            node = node[part]
    return out


def _follow(data: Any, loc: tuple) -> Any:
    node = data
    for part in _clean_loc(loc, data):
        node = node[part]
    return node

"""Reading a DeepSpeed config from whatever the user hands over: a dict, a path to a ``.json`` file, a JSON
string or base64-encoded JSON (what the ``deepspeed`` launcher passes on the command line)."""

from __future__ import annotations

import base64
import binascii
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_config._base import validate_section
from ds_config._errors import ConfigError, ConfigProblem

if TYPE_CHECKING:
    from ds_config.config import DeepSpeedConfig


class ConfigSourceError(ConfigError):
    """The config could not be read at all (missing/unreadable file, not a config source)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(ConfigProblem(key, "is given twice in the same JSON object; keep one"))
        out[key] = value
    return out


def _parse_hjson(text: str) -> Any:
    """``text`` as Hjson (JSON plus comments, unquoted keys and strings, optional commas), as DeepSpeed reads
    config files; ``_NOT_HJSON`` when it is not (or the ``hjson`` package is missing)."""
    try:
        import hjson
    except ImportError:  # a declared dependency; without it only strict JSON is read
        return _NOT_HJSON
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except (hjson.HjsonDecodeError, RecursionError):  # a duplicate key's ConfigError goes through
        return _NOT_HJSON


_NOT_HJSON = object()


def parse_json(text: str, origin: str = "JSON") -> dict[str, Any]:
    """Parse a JSON object (``Infinity`` allowed, duplicate keys rejected); text that is not JSON is read as
    Hjson, as DeepSpeed does (it reads config files with ``hjson``)."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        data = _parse_hjson(text)
        if data is _NOT_HJSON:
            raise ConfigError(ConfigProblem("", f"{origin} is not valid JSON: {exc.msg} at line {exc.lineno} "
                                                f"column {exc.colno} (nor valid Hjson)")) from None
    if not isinstance(data, dict):
        raise ConfigError(ConfigProblem("", f"{origin} must be a JSON object at the top level, "
                                            f"not {type(data).__name__}"))
    return data


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # tolerate a byte-order mark
    except FileNotFoundError:
        raise ConfigSourceError(ConfigProblem("", f"config file not found: {path}")) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigSourceError(ConfigProblem("", f"cannot read config file {path}: {exc}")) from None
    return parse_json(text, origin=f"config file {path}")


def _from_base64(text: str) -> dict[str, Any] | None:
    compact = "".join(text.split())
    try:
        raw = base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
        decoded = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    if not decoded.lstrip().startswith("{"):
        return None
    return parse_json(decoded, origin="base64-encoded config")


def _is_file(text: str) -> bool:
    try:
        return bool(text) and Path(text).is_file()
    except (OSError, ValueError):  # too long for a file name, or NUL bytes: not a path
        return False


def read_source(source: Any) -> dict[str, Any]:
    """The raw config dict from a dict, path, JSON text, base64 JSON text or bytes of either."""
    if isinstance(source, dict):
        return source
    if isinstance(source, bytes):
        source = source.decode("utf-8", errors="replace")
    if isinstance(source, os.PathLike):
        return _read_file(Path(source))
    if not isinstance(source, str):
        raise ConfigSourceError(ConfigProblem("", "a config must be a dict, a path to a .json file, a JSON "
                                                  f"string or base64-encoded JSON, not {type(source).__name__}"))
    text = source.strip()
    if text.startswith(("{", "[")):
        return parse_json(text)
    if _is_file(text):
        return _read_file(Path(text))
    decoded = _from_base64(text) if text else None
    if decoded is not None:
        return decoded
    if text.endswith(".json") or os.sep in text:
        raise ConfigSourceError(ConfigProblem("", f"config file not found: {text}"))
    raise ConfigSourceError(ConfigProblem("", "not a config: expected a path to a .json file, a JSON object "
                                              "or base64-encoded JSON"))


def load_config(source: Any, *, world_size: int | None = None, strict: bool = True) -> DeepSpeedConfig:
    """Parse and validate a DeepSpeed config.

    ``source``: dict, path (str or ``Path``) to a JSON file, JSON text, or base64-encoded JSON.
    ``world_size``: data-parallel size; when given, the batch keys are derived and checked.
    ``strict=False``: unknown keys warn (``UnknownConfigKeyWarning``) and are dropped instead of failing.
    Raises ``ConfigError`` (a ``ValueError``) whose problems name each bad key's full path.
    """
    from ds_config.config import DeepSpeedConfig

    if isinstance(source, DeepSpeedConfig):
        config = source
    else:
        data = read_source(source)
        try:
            config = validate_section(DeepSpeedConfig, data, strict=strict)
        except ConfigError as exc:
            raise ConfigError(exc.problems + _hidden_problems(data, exc.paths, world_size)) from None
    if world_size is not None:
        config.resolve_batch(world_size)
    return config


def _hidden_problems(data: dict[str, Any], reported: list[str], world_size: int | None) -> list[ConfigProblem]:
    """Problems a failed validation could not reach, so one run shows them all: cross-section checks (which
    need every section valid) among the sections that did validate, and the batch arithmetic.

    The sections with errors are left out (so they take their defaults, which are all "off" and cannot
    create a conflict of their own).
    """
    from ds_config.config import DeepSpeedConfig

    bad = {path.split(".")[0].split("[")[0] for path in reported}
    rest = {key: value for key, value in data.items() if key not in bad}
    extra: list[ConfigProblem] = []
    if len(rest) < len(data):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecations were already reported by the first validation
            try:
                validate_section(DeepSpeedConfig, rest, strict=False)
            except ConfigError as exc:
                extra = exc.problems
    if world_size is not None:
        extra += _batch_problems(data, world_size)
    seen = set(reported)
    return [p for p in extra if p.path not in seen and not seen.add(p.path)]


def _batch_problems(data: dict[str, Any], world_size: int) -> list[ConfigProblem]:
    """Batch-arithmetic problems of a config that failed validation elsewhere, so one run shows them all.

    Only plain positive integers are checked: a wrong type is already reported by validation, and elastic
    training (which owns the batch keys) is left to ``resolve_batch``.
    """
    from ds_config.batch import GAS, MBS, TBS, resolve_batch_sizes

    values = [data.get(key) for key in (TBS, MBS, GAS)]
    elastic = data.get("elasticity")
    if isinstance(elastic, dict) and elastic.get("enabled"):
        return []
    if any(v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0) for v in values):
        return []
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        return []
    try:
        resolve_batch_sizes(*values, world_size=world_size)
    except ConfigError as exc:
        return exc.problems
    return []

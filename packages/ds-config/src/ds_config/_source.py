"""Reading a DeepSpeed config from whatever the user hands over: a dict, a path to a ``.json`` file, a JSON
string or base64-encoded JSON (what the ``deepspeed`` launcher passes on the command line).

Below ``config`` (``DeepSpeedConfig.load`` reads through it); ``loader`` is the public face of these names."""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path
from typing import Any

from ds_config._errors import ConfigError, ConfigProblem


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

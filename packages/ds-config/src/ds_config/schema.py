"""JSON Schema of the DeepSpeed config, for editors (``"$schema"`` completion and validation)."""

from __future__ import annotations

import copy
from typing import Any

from ds_config._base import AUTO
from ds_config.config import DeepSpeedConfig

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_AUTO = {"const": AUTO, "description": "filled in by the Hugging Face integration, or the documented default"}


def _accepts_auto(prop: dict[str, Any]) -> bool:
    options = prop.get("anyOf") or prop.get("oneOf") or [prop]
    return any(o.get("const") == AUTO or (o.get("type") == "string" and "enum" not in o and "const" not in o)
               for o in options)


def _allow_auto(model_schema: dict[str, Any]) -> None:
    """Every key of a section also accepts ``"auto"`` (Hugging Face writes it; see ``_base``)."""
    for name, prop in (model_schema.get("properties") or {}).items():
        if name == "$schema" or _accepts_auto(prop):
            continue
        keep = {k: prop.pop(k) for k in ("title", "description", "default", "deprecated") if k in prop}
        model_schema["properties"][name] = {**keep, "anyOf": [prop, _AUTO]}


def config_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``ds_config.json``: every section, its keys, types and defaults."""
    schema = copy.deepcopy(DeepSpeedConfig.model_json_schema(mode="validation"))
    for model_schema in [schema, *schema.get("$defs", {}).values()]:
        _allow_auto(model_schema)
    schema = {"$schema": SCHEMA_DIALECT, **schema}
    schema["title"] = "DeepSpeed config (ds_config.json)"
    return schema

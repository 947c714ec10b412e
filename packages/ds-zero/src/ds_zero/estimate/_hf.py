"""Parameter counts of a Hugging Face model from its config alone, without downloading weights.

The model is instantiated on the meta device (shapes only, no storage), so even a 100B-parameter config
counts in seconds and a few MB of RAM. ``transformers`` is an optional dependency, imported only here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from ds_zero.estimate._count import ParamCounts, count_params

_INSTALL_HINT = "estimating from a Hugging Face config needs transformers: pip install transformers"


def _import_transformers() -> ModuleType:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return transformers


def _config_from_json_file(transformers: ModuleType, path: Path) -> object:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not read Hugging Face config file {str(path)!r}: {exc}") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"Hugging Face config file {str(path)!r} has no 'model_type' key, so the model "
                         "class cannot be chosen; pass the directory of a full checkpoint config instead")
    model_type = data.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ValueError(f"Hugging Face config file {str(path)!r}: {exc}") from exc


def load_hf_config(source: object, trust_remote_code: bool = False) -> object:
    """A transformers config from a config object, a ``config.json`` path, a directory holding one, or a hub
    model name (resolved from the local Hugging Face cache, else downloaded: the config file only)."""
    transformers = _import_transformers()
    config_base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    if isinstance(source, config_base):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError("hf config must be a transformers config object, a path to a config.json or its "
                        f"directory, or a hub model name; got {type(source).__name__}")
    path = Path(source)
    if path.is_file():
        return _config_from_json_file(transformers, path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"directory {str(path)!r} has no config.json")
    try:
        return transformers.AutoConfig.from_pretrained(os.fspath(source), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a Hugging Face config for {os.fspath(source)!r} (neither a local "
                         f"config.json nor a model found in the cache or on the hub): {exc}") from exc


def build_meta_model(config: object, auto_class: str = "AutoModel", trust_remote_code: bool = False) -> nn.Module:
    """Instantiate the model described by ``config`` on the meta device via ``transformers.<auto_class>``."""
    transformers = _import_transformers()
    factory = getattr(transformers, auto_class, None) if auto_class.startswith("Auto") else None
    if factory is None or not hasattr(factory, "from_config"):
        raise ValueError(f"auto_class must name a transformers Auto class with from_config (e.g. 'AutoModel', "
                         f"'AutoModelForCausalLM', 'AutoModelForSeq2SeqLM'), got {auto_class!r}")
    kwargs = {"trust_remote_code": True} if trust_remote_code else {}
    with torch.device("meta"):
        try:
            return factory.from_config(config, **kwargs)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"transformers.{auto_class} cannot build a model from this config on the meta "
                             f"device: {exc}") from exc


def hf_config_params(source: object, auto_class: str = "AutoModel", trust_remote_code: bool = False) -> ParamCounts:
    """``ParamCounts`` of the Hugging Face model described by ``source`` (see ``load_hf_config``), counted on
    the meta device: no weights are downloaded or allocated."""
    config = load_hf_config(source, trust_remote_code)
    return count_params(build_meta_model(config, auto_class, trust_remote_code))

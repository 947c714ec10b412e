"""Does the installed Transformers build have the MoE classes a preset was written for?

Imported lazily: Transformers is loaded only when a Hugging Face model of a preset's ``model_type`` is
converted. A build that is too old (per-expert ``nn.ModuleList`` layout, or no such model at all) fails here,
naming the preset, the model_type and the installed version, instead of deep inside the conversion.
"""

from __future__ import annotations

import importlib
import re

from ds_config import ConfigError, ConfigProblem
from ds_moe.autoep.presets import HF_MODULE_DIRS, MoEModelPreset

KEY = "expert_parallel.preset_model"


def _version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: '5.2.0.dev0' -> (5, 2, 0); unparsable parts stop it."""
    parts = []
    for piece in version.split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.group() != piece:
            break
    return tuple(parts)


def transformers_version() -> str | None:
    """The installed Transformers version, or None when it cannot be imported."""
    try:
        import transformers
    except ImportError:
        return None
    return str(getattr(transformers, "__version__", "unknown"))


def check_transformers_support(preset: MoEModelPreset, model_type: str) -> None:
    """Raise ``ConfigError`` unless this Transformers build exposes ``preset``'s classes for ``model_type``."""
    version = transformers_version()
    needs = f"needs Transformers >= {preset.min_transformers_version} (fused expert layout)"
    where = f"AutoEP preset '{preset.name}' for model_type '{model_type}'"
    if version is None:
        raise ConfigError(ConfigProblem(KEY, f"{where} {needs}, but transformers cannot be imported", preset.name))
    if _version_tuple(version) < _version_tuple(preset.min_transformers_version):
        raise ConfigError(ConfigProblem(KEY, f"{where} {needs}; installed transformers=={version}. Upgrade "
                                        "Transformers or choose a preset this version supports", preset.name))
    names = preset.hf_classes.get(model_type, ())
    folder = HF_MODULE_DIRS.get(model_type, model_type)
    module_name = f"transformers.models.{folder}.modeling_{folder}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(ConfigProblem(KEY, f"{where} {needs}; installed transformers=={version} has no "
                                        f"{module_name} ({exc})", preset.name)) from exc
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise ConfigError(ConfigProblem(KEY, f"{where} {needs}; installed transformers=={version} lacks "
                                        f"{', '.join(missing)} in {module_name}", preset.name))

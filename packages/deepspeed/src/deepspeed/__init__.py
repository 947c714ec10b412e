"""DeepSpeed, modular: the meta-package.

Serves the documented DeepSpeed API and every documented module path (see ``deepspeed._compat_paths``)
from the component packages (ds_config, ds_ops, ds_zero, ...).

Top-level names are resolved on first use, so ``import deepspeed`` stays cheap: the ``deepspeed`` launcher
imports this package and must start without paying for torch; its ranks import torch themselves.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from deepspeed import compat as _compat
from deepspeed.__about__ import __version__

_compat.install()

version = __version__  # DeepSpeed's names for it (deepspeed.git_version_info.version is the same string)
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in re.findall(r"\d+", __version__)[:3])

# public name -> (module, attribute or None for the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "DeepSpeedConfig": ("deepspeed.runtime.config", "DeepSpeedConfig"),  # DeepSpeed's (path or dict, mpu) class
    # DeepSpeed's config exception is ds_config's ConfigError itself (a ValueError), so
    # ``except deepspeed.DeepSpeedConfigError`` catches every config error this package raises
    "DeepSpeedConfigError": ("ds_config", "ConfigError"),
    "OnDevice": ("deepspeed.utils.init_on_device", "OnDevice"),
    "git_hash": ("deepspeed.git_version_info", "git_hash"),
    "git_branch": ("deepspeed.git_version_info", "git_branch"),
    "__git_hash__": ("deepspeed.git_version_info", "git_hash"),
    "__git_branch__": ("deepspeed.git_version_info", "git_branch"),
    "DeepSpeedEngine": ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    "PipelineEngine": ("deepspeed.runtime.pipe.engine", "PipelineEngine"),
    "DeepSpeedDataLoader": ("deepspeed.runtime.dataloader", "DeepSpeedDataLoader"),
    "DeepSpeedOptimizer": ("deepspeed.runtime.base_optimizer", "DeepSpeedOptimizer"),
    "ZeROOptimizer": ("deepspeed.runtime.base_optimizer", "ZeROOptimizer"),
    "DeepSpeedInferenceConfig": ("ds_config.inference", "DeepSpeedInferenceConfig"),
    "init_inference": ("ds_inference", "init_inference"),
    "default_inference_config": ("ds_inference", "default_inference_config"),
    "InferenceEngine": ("ds_inference.engine", "InferenceEngine"),
    "DeepSpeedTransformerLayer": ("ds_ops.transformer", "DeepSpeedTransformerLayer"),
    "DeepSpeedTransformerConfig": ("ds_ops.transformer", "DeepSpeedTransformerConfig"),
    "get_accelerator": ("deepspeed.accelerator", "get_accelerator"),
    "PipelineModule": ("ds_pipe.module", "PipelineModule"),
    "add_config_arguments": ("deepspeed._initialize", "add_config_arguments"),
    "add_tuning_arguments": ("deepspeed.runtime.lr_schedules", "add_tuning_arguments"),
    "comm": ("deepspeed.comm", None),
    "initialize": ("deepspeed._initialize", "initialize"),
    "tp_model_init": ("deepspeed.runtime.autotp", "tp_model_init"),
    "set_autotp_mode": ("ds_inference.autotp", "set_autotp_mode"),
    "init_distributed": ("deepspeed.comm.comm", "init_distributed"),
    "log_dist": ("deepspeed.utils", "log_dist"),
    "logger": ("deepspeed.utils", "logger"),
}

__all__ = ["__version__", "version", *_LAZY]


_submodule = _compat.submodule_getattr(__name__)


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        from deepspeed._compat_paths import NOT_BUILT_NAMES

        if name in NOT_BUILT_NAMES:
            raise AttributeError(_compat.not_built_message(f"deepspeed.{name}", NOT_BUILT_NAMES[name])) from None
        return _submodule(name)  # deepspeed.runtime, deepspeed.ops, ... as attributes, as DeepSpeed has them
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

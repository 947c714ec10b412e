"""Layer reduction: a student keeps ``keep_number_layer`` layers, initialized from chosen teacher layers
(``module_name_prefix`` + ``teacher_layer``) and from same-named teacher modules (``other_module_name``), the
usual start of knowledge distillation.
"""

from __future__ import annotations

from torch import nn

from deepspeed.compression.config import SECTION
from deepspeed.compression.helper import recursive_getattr
from deepspeed.utils.logging import logger

_WHERE = f"{SECTION}.layer_reduction"


def _module(model: nn.Module, name: str, role: str) -> nn.Module:
    try:
        return recursive_getattr(model, name)
    except AttributeError:
        raise ValueError(f"{_WHERE}: the {role} model has no module {name!r}") from None


def _copy_module(student: nn.Module, teacher: nn.Module, what: str) -> None:
    """Copy ``teacher``'s parameters and buffers into ``student`` (same structure and shapes)."""
    source, target = teacher.state_dict(), student.state_dict()
    if source.keys() != target.keys():
        raise ValueError(f"{_WHERE}: {what} differ in structure; teacher-only: "
                         f"{sorted(source.keys() - target.keys())[:5]}, student-only: "
                         f"{sorted(target.keys() - source.keys())[:5]}")
    for key, value in source.items():
        if value.shape != target[key].shape:
            raise ValueError(f"{_WHERE}: {what}: {key} has shape {tuple(value.shape)} in the teacher but "
                             f"{tuple(target[key].shape)} in the student")
    student.load_state_dict(source)


def _kept_layers(student: nn.Module, prefix: str, keep: int) -> nn.Module:
    """The student's layer container, cut to ``keep`` layers when it holds more (e.g. a copy of the teacher)."""
    layers = _module(student, prefix, "student")
    if len(layers) < keep:
        raise ValueError(f"{_WHERE}.keep_number_layer: the student's {prefix!r} has {len(layers)} layers, fewer "
                         f"than keep_number_layer={keep}")
    if len(layers) > keep:
        if not isinstance(layers, nn.ModuleList | nn.Sequential):
            raise ValueError(f"{_WHERE}: the student's {prefix!r} ({type(layers).__name__}) has {len(layers)} "
                             f"layers and cannot be cut to keep_number_layer={keep}; build it with {keep} layers")
        del layers[keep:]
    return layers


def _update_layer_count(student: nn.Module, teacher: nn.Module, before: int, keep: int) -> None:
    """A Hugging Face student's ``config.num_hidden_layers`` follows the cut (``save_pretrained`` / reloading and
    the KV cache read it), when it counted the cut container's layers."""
    config = getattr(student, "config", None)
    if before == keep or getattr(config, "num_hidden_layers", None) != before:
        return
    if config is getattr(teacher, "config", None):
        logger.warning(f"{_WHERE}: the student shares its config object with the teacher, so "
                       f"config.num_hidden_layers stays {before}; build the student with its own config")
        return
    config.num_hidden_layers = keep


def student_initialization(student_model: nn.Module, teacher_model: nn.Module, deepspeed_config: object) -> None:
    """Initialize ``student_model`` from ``teacher_model`` as ``compression_training.layer_reduction`` says:
    student layer ``i`` (under ``module_name_prefix``, cut to ``keep_number_layer`` layers) takes teacher layer
    ``teacher_layer[i]``; every module in ``other_module_name`` takes the teacher's module of the same name.
    A Hugging Face student's ``config.num_hidden_layers`` is set to the kept count when the layers were cut."""
    from deepspeed.compression.config import get_compression_config

    cfg = get_compression_config(deepspeed_config).layer_reduction
    if cfg.module_name_prefix is not None and cfg.teacher_layer is not None:
        keep = cfg.keep_number_layer or len(cfg.teacher_layer)
        before = len(_module(student_model, cfg.module_name_prefix, "student"))
        s_layers = _kept_layers(student_model, cfg.module_name_prefix, keep)
        _update_layer_count(student_model, teacher_model, before, keep)
        t_layers = _module(teacher_model, cfg.module_name_prefix, "teacher")
        for s_idx, t_idx in enumerate(cfg.teacher_layer):
            if not 0 <= t_idx < len(t_layers):
                raise ValueError(f"{_WHERE}.teacher_layer: layer {t_idx} does not exist; the teacher's "
                                 f"{cfg.module_name_prefix!r} has {len(t_layers)} layers")
            _copy_module(s_layers[s_idx], t_layers[t_idx],
                         f"student layer {s_idx} and teacher layer {t_idx} of {cfg.module_name_prefix!r}")
    for name in cfg.other_module_name or []:
        _copy_module(_module(student_model, name, "student"), _module(teacher_model, name, "teacher"),
                     f"the student's and the teacher's {name!r}")

"""Builders of the ops that run on torch's own kernels: FusedAdam, FusedLamb, FusedLion (DeepSpeed's names).

DeepSpeed compiles these from CUDA sources; here they are torch's fused/multi-tensor kernels, so there is
nothing to compile: ``load()`` imports the op's module (which holds the optimizer class) and the op is
compatible wherever the installed torch has the kernels it calls.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import ClassVar

from ds_ops.op_builder._builder import OpBuildError


class TorchOpBuilder:
    """An op with no native code of its own: ``NAME``, ``BUILD_VAR``, ``MODULE`` (what ``load()`` returns) and
    ``TORCH_KERNELS`` (``torch`` attributes it calls; a torch without them makes the op incompatible)."""

    NAME: ClassVar[str]
    BUILD_VAR: ClassVar[str]
    MODULE: ClassVar[str]
    TORCH_KERNELS: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return self.MODULE

    def sources(self) -> list[Path]:
        """The Python module implementing the op (there is nothing to compile)."""
        spec = importlib.util.find_spec(self.MODULE)
        return [Path(spec.origin)] if spec is not None and spec.origin else []

    def compatibility_problems(self) -> list[str]:
        """Why the op cannot run here (empty when it can): kernels missing from the installed torch."""
        import torch

        missing = [f"torch.{k}" for k in self.TORCH_KERNELS if not hasattr(torch, k)]
        return [f"torch {torch.__version__} lacks {', '.join(missing)}"] if missing else []

    def is_compatible(self, verbose: bool = False) -> bool:
        problems = self.compatibility_problems()
        if verbose and problems:
            print(f"[ds_ops] {self.NAME} is not compatible: " + " ".join(problems))
        return not problems

    def load(self, verbose: bool = True) -> ModuleType:
        """The op's module (``load().FusedAdam`` is the optimizer); ``verbose`` has nothing to report."""
        problems = self.compatibility_problems()
        if problems:
            raise OpBuildError(f"cannot load op {self.NAME!r}: " + " ".join(problems))
        return importlib.import_module(self.MODULE)

    def jit_load(self, verbose: bool = True) -> ModuleType:
        return self.load(verbose)


class FusedAdamBuilder(TorchOpBuilder):
    """Adam/AdamW on torch's fused kernel (``ds_ops.adam.fused_adam.FusedAdam``)."""

    NAME = "fused_adam"
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    MODULE = "ds_ops.adam.fused_adam"
    TORCH_KERNELS = ("_fused_adam_", "_fused_adamw_", "_foreach_add_")


class FusedLambBuilder(TorchOpBuilder):
    """LAMB on torch's multi-tensor kernels (``ds_ops.lamb.fused_lamb.FusedLamb``)."""

    NAME = "fused_lamb"
    BUILD_VAR = "DS_BUILD_FUSED_LAMB"
    MODULE = "ds_ops.lamb.fused_lamb"
    TORCH_KERNELS = ("_foreach_norm", "_foreach_lerp_", "_foreach_addcmul_", "_foreach_sqrt", "_foreach_div_")


class FusedLionBuilder(TorchOpBuilder):
    """Lion on torch's multi-tensor kernels (``ds_ops.lion.fused_lion.FusedLion``)."""

    NAME = "fused_lion"
    BUILD_VAR = "DS_BUILD_FUSED_LION"
    MODULE = "ds_ops.lion.fused_lion"
    TORCH_KERNELS = ("_foreach_mul_", "_foreach_add_", "_foreach_sign_")

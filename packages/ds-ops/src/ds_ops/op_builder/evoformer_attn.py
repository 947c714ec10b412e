"""``EvoformerAttnBuilder`` (``deepspeed.ops.op_builder.evoformer_attn``): the build checks of DeepSpeed4Science's
Evoformer attention kernel, a CUTLASS-based CUDA kernel.

What it checks, as DeepSpeed does: CUTLASS headers found (``CUTLASS_PATH``, the ``nvidia-cutlass`` Python package,
prefixes such as ``CMAKE_PREFIX_PATH``/``CONDA_PREFIX``, compiler include paths, the usual system folders) and
at least version 3.1; CUDA 11+ for torch and the toolkit; a GPU of compute capability 7.0+ (Tensor Cores), with
older build targets pruned. ``CUTLASS_PATH=DS_IGNORE_CUTLASS_DETECTION`` trusts an external setup,
``CUTLASS_PATH=DS_USE_CUTLASS_PYTHON_BINDINGS`` takes the headers from ``nvidia-cutlass`` only.

This version does not ship the CUTLASS kernel sources, so the op is never compatible (``load()`` says so);
``deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention`` computes the same attention in torch instead.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import torch

from ds_ops.op_builder.builder import CUDAOpBuilder, installed_cuda_version

MIN_CUTLASS = (3, 1, 0)
_PREFIX_VARS = ("CUTLASS_ROOT", "CUTLASS_HOME", "CONDA_PREFIX", "VIRTUAL_ENV", "CMAKE_PREFIX_PATH", "CUDA_HOME",
                "CUDA_PATH")
_INCLUDE_VARS = ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH")


class EvoformerAttnBuilder(CUDAOpBuilder):
    """DeepSpeed's Evoformer attention op: CUTLASS discovery, CUDA/compute-capability checks, nvcc targets."""

    NAME = "evoformer_attn"
    BUILD_VAR = "DS_BUILD_EVOFORMER_ATTN"
    CUTLASS_IGNORE = "DS_IGNORE_CUTLASS_DETECTION"
    CUTLASS_PYTHON_BINDINGS = "DS_USE_CUTLASS_PYTHON_BINDINGS"

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.cutlass_path = os.environ.get("CUTLASS_PATH")
        self._resolved_cutlass_path: Path | None = None

    def extra_ldflags(self) -> list[str]:
        return [] if self.is_rocm_pytorch() else ["-lcurand"]

    def nvcc_args(self) -> list[str]:
        if os.environ.get("DS_EVOFORMER_GPU_ARCH"):
            self.warning("DS_EVOFORMER_GPU_ARCH is deprecated and ignored for Evoformer builds. "
                         "Use TORCH_CUDA_ARCH_LIST to control build targets.")
        return super().nvcc_args()

    def filter_ccs(self, ccs: list[str]) -> list[list[str]]:
        """Only Tensor Core targets (compute capability 7.0 and up); the pruned ones are reported."""
        split = [cc.split(".") for cc in ccs]
        kept = [cc for cc in split if int(cc[0]) >= 7]
        pruned = [".".join(cc) for cc in split if int(cc[0]) < 7]
        if pruned:
            self.warning(f"Evoformer: excluding targets below SM 7.0 (no Tensor Cores): {pruned}")
        return kept

    # ---- CUTLASS discovery ----------------------------------------------------------------------
    @staticmethod
    def _python_package_cutlass_paths() -> list[Path]:
        """Folders of the ``nvidia-cutlass`` package (module ``cutlass_library``) that may hold the headers."""
        try:
            library = importlib.import_module("cutlass_library")
        except ImportError:
            return []
        found = []
        if getattr(library, "source_path", None) is not None:
            found.append(Path(library.source_path))
        if getattr(library, "__file__", None) is not None:
            package = Path(library.__file__).resolve().parent
            found += [package / "source", package.parent, package]
        return found

    @staticmethod
    def _env_paths(names: tuple[str, ...]) -> list[Path]:
        return [Path(p) for name in names for p in os.environ.get(name, "").split(os.pathsep) if p]

    def _candidate_cutlass_paths(self) -> list[Path]:
        """Where to look, first match wins: CUTLASS_PATH alone when set, else every usual place."""
        if self.cutlass_path == self.CUTLASS_PYTHON_BINDINGS:
            found = self._python_package_cutlass_paths()
            if not found:
                raise ImportError(f"CUTLASS_PATH={self.CUTLASS_PYTHON_BINDINGS} asks for the nvidia-cutlass Python "
                                  "package, which is not installed: pip install nvidia-cutlass")
            return found
        if self.cutlass_path:
            return [Path(self.cutlass_path)]
        candidates = [
            *self._python_package_cutlass_paths(),
            *self._env_paths(_PREFIX_VARS),
            Path(sys.prefix), Path(sys.exec_prefix), Path(sys.base_prefix),
            *self._env_paths(_INCLUDE_VARS),
            Path.cwd() / "cutlass", Path("/usr/local/cutlass"), Path("/opt/cutlass"), Path("/usr/local"), Path("/usr"),
        ]
        unique: dict[str, Path] = {}
        for path in candidates:
            unique.setdefault(str(path.expanduser()), path.expanduser())
        return list(unique.values())

    @staticmethod
    def _cutlass_include_dirs(path: Path) -> list[str]:
        """[include root, tools/util/include when present] for a CUTLASS checkout/prefix or its include folder."""
        path = path.expanduser()
        if (path / "include" / "cutlass" / "cutlass.h").is_file():
            root, util = path / "include", path / "tools" / "util" / "include"
        elif (path / "cutlass" / "cutlass.h").is_file():
            root, util = path, path.parent / "tools" / "util" / "include"
        else:
            return []
        return [str(root)] + ([str(util)] if util.is_dir() else [])

    def include_paths(self) -> list[str]:
        """CUTLASS's include folders; raises RuntimeError when none of the candidates holds the headers."""
        if self.cutlass_path == self.CUTLASS_IGNORE:
            return []
        for path in self._candidate_cutlass_paths():
            dirs = self._cutlass_include_dirs(path)
            if dirs:
                self._resolved_cutlass_path = Path(dirs[0])
                return dirs
        if self.cutlass_path:
            raise RuntimeError(f"CUTLASS_PATH={self.cutlass_path} does not contain the CUTLASS headers "
                               "(include/cutlass/cutlass.h).")
        raise RuntimeError("Unable to locate CUTLASS: pip install nvidia-cutlass, or set CUTLASS_PATH to a CUTLASS "
                           f"checkout (or CUTLASS_PATH={self.CUTLASS_IGNORE} when the compiler already finds it).")

    def cutlass_version(self) -> tuple[int, int, int] | None:
        """The found CUTLASS's version from ``cutlass/version.h`` (else its checkout's CHANGELOG.md), or None."""
        if self._resolved_cutlass_path is None:
            return None
        header = self._resolved_cutlass_path / "cutlass" / "version.h"
        if header.is_file():
            text = header.read_text(errors="replace")
            parts = [re.search(rf"#define\s+CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
            if all(parts):
                return tuple(int(p.group(1)) for p in parts)  # type: ignore[return-value]
        changelog = self._resolved_cutlass_path.parent / "CHANGELOG.md"
        if changelog.is_file():
            found = re.findall(r"^##\s*\[?(\d+)\.(\d+)\.(\d+)", changelog.read_text(errors="replace"), re.M)
            if found:
                return max(tuple(int(x) for x in v) for v in found)  # type: ignore[return-value]
        return None

    # ---- compatibility --------------------------------------------------------------------------
    def _cutlass_problems(self) -> list[str]:
        if self.cutlass_path == self.CUTLASS_IGNORE:
            return []
        try:
            self.include_paths()
        except (RuntimeError, ImportError) as exc:
            return [str(exc)]
        version = self.cutlass_version()
        if version is not None and version < MIN_CUTLASS:
            return [f"CUTLASS {'.'.join(map(str, version))} at {self._resolved_cutlass_path} is too old: "
                    f"Evoformer attention needs CUTLASS >= {'.'.join(map(str, MIN_CUTLASS))}."]
        return []

    def _cuda_problems(self) -> list[str]:
        if os.environ.get("DS_IGNORE_CUDA_DETECTION") or self.is_rocm_pytorch() or not torch.cuda.is_available():
            return []
        problems = []
        capability = self.cuda_capability_major()
        if capability is not None and capability < 7:
            problems.append(f"Evoformer attention needs a GPU of compute capability >= 7.0; GPU 0 is {capability}.x.")
        try:
            toolkit_major = installed_cuda_version(self.name)[0]
        except Exception as exc:  # noqa: BLE001 - a missing toolkit is reported, not raised, by a compatibility check
            return [*problems, str(exc)]
        torch_major = int(torch.version.cuda.split(".")[0])
        if min(toolkit_major, torch_major) < 11:
            problems.append(f"Evoformer attention needs CUDA 11+ (toolkit {toolkit_major}, torch built with "
                            f"{torch.version.cuda}).")
        return problems

    def compatibility_problems(self) -> list[str]:
        return [*self._cutlass_problems(), *self._cuda_problems(), *super().compatibility_problems()]

    def sources_problem(self) -> str:
        return ("this version does not ship DeepSpeed's CUTLASS Evoformer kernel; "
                "deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention computes the attention in torch.")

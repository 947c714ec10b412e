"""``deepspeed.ops.op_builder.builder`` (``ds_ops.op_builder.builder``): DeepSpeed's op-builder base module:
``OpBuilder`` (the builder class, with its toolchain probes), the CUDA-toolkit checks scripts run before
building CUDA extensions, and ``CUDAOpBuilder``, the base of ops compiled from CUDA sources with nvcc."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch

from ds_ops.op_builder._builder import OpBuilder, OpBuildError, cache_root
from ds_ops.op_builder.cuda_archs import (
    ArchList,
    arch_list_string,
    canonical_archs,
    default_compute_capabilities,
    gencode_flags,
    parse_arch_list,
    split_archs,
)

__all__ = ["CUDAMismatchException", "CUDAOpBuilder", "MissingCUDAException", "OpBuildError", "OpBuilder",
           "assert_no_cuda_mismatch", "default_compute_capabilities", "installed_cuda_version"]


class MissingCUDAException(Exception):
    """No CUDA toolkit (nvcc under CUDA_HOME) where one is needed."""


class CUDAMismatchException(Exception):
    """The CUDA toolkit's major version differs from the one torch was built with."""


def _cuda_home() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    return os.environ.get("CUDA_HOME") or CUDA_HOME


def installed_cuda_version(name: str = "") -> tuple[int, int]:
    """``(major, minor)`` of the toolkit's ``nvcc`` (not torch's CUDA); ``name`` labels the op asking."""
    home = _cuda_home()
    nvcc = os.path.join(home, "bin", "nvcc") if home else None
    if nvcc is None or not os.path.exists(nvcc):
        raise MissingCUDAException(f"{name or 'this op'} needs the CUDA toolkit: no nvcc found (CUDA_HOME="
                                   f"{home!r}); install it or set CUDA_HOME")
    out = subprocess.run([nvcc, "-V"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    if found is None:
        raise MissingCUDAException(f"could not read the CUDA release from `{nvcc} -V`: {out.strip()!r}")
    return int(found.group(1)), int(found.group(2))


def assert_no_cuda_mismatch(name: str = "") -> bool:
    """True when the toolkit and torch's CUDA share a major version; a mismatch raises (set
    ``DS_SKIP_CUDA_CHECK=1`` to only warn and return False, as DeepSpeed allows)."""
    major, minor = installed_cuda_version(name)
    if torch.version.cuda is None:
        raise CUDAMismatchException(f"{name or 'this op'}: torch is a CPU build; a CUDA op cannot be built for it")
    torch_major, torch_minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    if major == torch_major:
        return True
    message = (f"{name or 'this op'}: the CUDA toolkit is {major}.{minor} but torch was built with "
               f"{torch_major}.{torch_minor}")
    if os.environ.get("DS_SKIP_CUDA_CHECK", "0") == "1":
        warnings.warn(message + " (DS_SKIP_CUDA_CHECK=1: building anyway)", stacklevel=2)
        return False
    raise CUDAMismatchException(message)


def _toolkit_or_none() -> tuple[int, int] | None:
    try:
        return installed_cuda_version()
    except MissingCUDAException:
        return None


class CUDAOpBuilder:
    """An op compiled from CUDA sources with nvcc (torch.utils.cpp_extension + ninja) and loaded as a Python
    extension module: DeepSpeed's ``CUDAOpBuilder``.

    Subclasses set ``NAME`` and return their files from :meth:`sources` (``BUILD_VAR`` follows from ``NAME``).
    Targets: ``TORCH_CUDA_ARCH_LIST`` when set, else (JIT) the visible GPUs' capabilities, else (cross compile)
    :func:`default_compute_capabilities` for the toolkit; :meth:`filter_ccs` drops those the op cannot run on.
    The JIT cache is ``$DS_OPS_CACHE_DIR/cuda/<name>``.
    """

    NAME: ClassVar[str]
    BUILD_VAR: ClassVar[str]
    _loaded_ops: ClassVar[dict[str, ModuleType]] = {}

    is_rocm_pytorch = staticmethod(OpBuilder.is_rocm_pytorch)
    installed_rocm_version = staticmethod(OpBuilder.installed_rocm_version)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "NAME" in cls.__dict__ and "BUILD_VAR" not in cls.__dict__:
            cls.BUILD_VAR = f"DS_BUILD_{cls.NAME.upper()}"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME
        self.jit_mode = False  # True while load() builds: targets come from the visible GPUs
        self.build_for_cpu = False
        self.enable_bf16 = True  # cleared by compute_capability_args when a target predates sm_80's bf16
        self.error_log: str | None = None

    # ---- what to compile ------------------------------------------------------------------------
    def absolute_name(self) -> str:
        return f"ds_ops.{self.name}_op"

    def sources(self) -> list[str]:
        return []

    def include_paths(self) -> list[str]:
        return []

    def extra_ldflags(self) -> list[str]:
        return []

    def cxx_args(self) -> list[str]:
        std = "-std=c++20" if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 12) else "-std=c++17"
        return ["-O3", std, "-g", "-Wno-reorder"]

    def nvcc_args(self) -> list[str]:
        if self.build_for_cpu:
            return []
        args = ["-O3"]
        if self.is_rocm_pytorch():
            major, minor = self.installed_rocm_version()
            return args + ["-std=c++17", "-U__HIP_NO_HALF_OPERATORS__", "-U__HIP_NO_HALF_CONVERSIONS__",
                           "-U__HIP_NO_HALF2_OPERATORS__", f"-DROCM_VERSION_MAJOR={major}",
                           f"-DROCM_VERSION_MINOR={minor}"]
        cuda_major, cuda_minor = installed_cuda_version(self.name)
        std = "-std=c++20" if (cuda_major, cuda_minor) >= (12, 5) else "-std=c++17"
        threads = os.environ.get("DS_NVCC_THREADS", "")
        threads = int(threads) if threads.isdigit() and int(threads) > 0 else min(os.cpu_count() or 1, 8)
        args += ["--use_fast_math", std, "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                 "-U__CUDA_NO_HALF2_OPERATORS__", f"--threads={threads}"]
        if sys.platform == "win32":
            args.append("-allow-unsupported-compiler")
        if os.environ.get("DS_DEBUG_CUDA_BUILD", "0") == "1":
            args.append("--ptxas-options=-v")
        return args + self.compute_capability_args()

    # ---- targets --------------------------------------------------------------------------------
    def cuda_capability_major(self) -> int | None:
        """Compute-capability major of GPU 0, or None when reading it would create a CUDA context (none exists
        yet, or this is a forked child of a process that had one): checking compatibility must not do that."""
        if not torch.cuda.is_initialized():
            return None
        if getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
            return None
        return torch.cuda.get_device_properties(0).major

    def filter_ccs(self, ccs: list[str]) -> ArchList:
        """The targets this op can be built for, as ``[[major, minor], ...]``; ops with hardware needs override
        this (and say what they pruned)."""
        return split_archs(ccs)

    def _requested_ccs(self, cross_compile_archs: str | None) -> list[str]:
        env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
        if env:
            if cross_compile_archs is not None and not self.jit_mode:
                self.warning(f"TORCH_CUDA_ARCH_LIST={env} overrides cross_compile_archs={cross_compile_archs}")
            return parse_arch_list(env)
        if not self.jit_mode:
            if cross_compile_archs is not None:
                return parse_arch_list(cross_compile_archs, "cross_compile_archs")
            return default_compute_capabilities(_toolkit_or_none())
        if getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
            raise OpBuildError(f"building op {self.name!r} in a forked process where CUDA was already initialized "
                               "cannot probe the GPUs; set TORCH_CUDA_ARCH_LIST to the targets, e.g. '8.0;9.0'")
        ccs = sorted({"{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())},
                     key=lambda cc: tuple(int(p) for p in cc.split(".")))
        if not ccs:
            raise OpBuildError(f"building op {self.name!r}: no CUDA device is visible; set TORCH_CUDA_ARCH_LIST "
                               "to the targets or make the GPUs visible")
        return ccs[:-1] + [ccs[-1] + "+PTX"]  # PTX of the newest so later GPUs can still JIT the kernels

    def compute_capability_args(self, cross_compile_archs: str | None = None) -> list[str]:
        """nvcc ``-gencode`` flags for the targets (see the class docstring), after :meth:`filter_ccs`.

        Also sets ``TORCH_CUDA_ARCH_LIST`` to the filtered targets, so torch's extension builder does not add
        back targets the op cannot run on; in JIT mode torch derives the flags from it and this returns none.
        """
        archs = canonical_archs(self.filter_ccs(self._requested_ccs(cross_compile_archs)))
        if not archs:
            raise OpBuildError(f"op {self.name!r}: no compute capability is left to build for after filtering")
        self.enable_bf16 = all(major >= 8 for major, _, _ in archs)
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list_string(archs)
        return [] if self.jit_mode else gencode_flags(archs)

    # ---- status ---------------------------------------------------------------------------------
    def warning(self, msg: str) -> None:
        """Report a build/compatibility problem: kept in ``error_log`` (load() errors quote it) and printed."""
        self.error_log = msg
        print(f"[WARNING] {msg}", file=sys.stderr)

    def compatibility_problems(self) -> list[str]:
        """Why this op cannot be built here (empty when it can): a CPU-only torch, no nvcc, no sources."""
        problems = []
        if torch.version.cuda is None and not self.is_rocm_pytorch():
            problems.append(f"op {self.name!r} needs a CUDA or ROCm build of torch; this is torch {torch.__version__}.")
        elif not self.is_rocm_pytorch() and _toolkit_or_none() is None:
            problems.append(f"op {self.name!r} needs the CUDA toolkit (nvcc); set CUDA_HOME to its folder.")
        if not self.sources():
            problems.append(self.sources_problem())
        return problems

    def sources_problem(self) -> str:
        """What compatibility_problems says when :meth:`sources` is empty."""
        return f"op {self.name!r} has no sources to compile."

    def is_compatible(self, verbose: bool = False) -> bool:
        problems = self.compatibility_problems()
        if verbose:
            for problem in problems:
                self.warning(problem)
        return not problems

    def is_built(self) -> bool:
        return self.name in CUDAOpBuilder._loaded_ops

    # ---- build / load ---------------------------------------------------------------------------
    def load(self, verbose: bool = False) -> ModuleType:
        """The extension module, built on first use into the JIT cache (CUDA ops are never prebuilt here)."""
        if self.name in CUDAOpBuilder._loaded_ops:
            return CUDAOpBuilder._loaded_ops[self.name]
        return self.jit_load(verbose)

    def jit_load(self, verbose: bool = True) -> ModuleType:
        problems = self.compatibility_problems()
        if problems:
            raise OpBuildError(f"cannot build op {self.name!r}: " + " ".join(problems))
        if not self.is_rocm_pytorch():
            assert_no_cuda_mismatch(self.name)
        from torch.utils import cpp_extension

        saved_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
        self.jit_mode = True
        start = time.perf_counter()
        try:
            nvcc = [*self.nvcc_args(), "-UC10_USE_GLOG"]
            cxx = [*self.cxx_args(), "-UC10_USE_GLOG"]
            if self.enable_bf16 and not self.is_rocm_pytorch():
                cxx.append("-DBF16_AVAILABLE")
                nvcc += ["-DBF16_AVAILABLE", "-U__CUDA_NO_BFLOAT16_OPERATORS__",
                         "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
            build_dir = cache_root() / "cuda" / self.name
            build_dir.mkdir(parents=True, exist_ok=True)
            module = cpp_extension.load(
                name=self.name, sources=[str(Path(s).resolve()) for s in self.sources()],
                extra_include_paths=[str(Path(p).resolve()) for p in self.include_paths()],
                extra_cflags=cxx, extra_cuda_cflags=nvcc, extra_ldflags=self.extra_ldflags(),
                build_directory=str(build_dir), with_cuda=True, verbose=verbose)
        except (RuntimeError, OSError, SystemExit) as exc:
            raise OpBuildError(f"compiling op {self.name!r} failed: {exc}") from exc
        finally:
            self.jit_mode = False
            if saved_arch_list is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = saved_arch_list
        if verbose:
            print(f"Time to load {self.name} op: {time.perf_counter() - start:.1f} seconds")
        CUDAOpBuilder._loaded_ops[self.name] = module
        return module

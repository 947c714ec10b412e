"""Build-and-load for native ops: JIT with torch.utils.cpp_extension + ninja into a keyed cache, or a
prebuilt library shipped in the wheel (DS_BUILD_OPS=1 at install).

The C++ sources expose plain C entry points and include no torch headers, so a build takes seconds and
a cached load is one ``dlopen`` (no ninja run, no torch extension machinery on the warm path).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import ClassVar

from ds_ops.op_builder import _cpu, toolchain
from ds_ops.op_builder._lock import LockTimeout, file_lock

ABI_VERSION = 1
CACHE_ENV = "DS_OPS_CACHE_DIR"
CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
PREBUILT_DIR = Path(__file__).resolve().parent.parent / "_prebuilt"
_BASE_FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-DNDEBUG")

_loaded: dict[str, ctypes.CDLL] = {}
_loaded_lock = threading.Lock()


class OpBuildError(RuntimeError):
    """A native op cannot be built or loaded here; the message says what is missing and how to fix it."""


def cache_root() -> Path:
    """Where JIT builds live: ``$DS_OPS_CACHE_DIR``, else ``$XDG_CACHE_HOME/ds_ops`` (``~/.cache/ds_ops``)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ds_ops"


class OpBuilder:
    """One native library: its sources, flags, cache location, build and load.

    Subclasses set ``NAME``, ``SOURCES`` (files under csrc/; headers there are hashed too) and
    ``SYMBOLS`` (entry points that must exist after loading); ``BUILD_VAR`` (DeepSpeed's name for the
    install-time switch that prebuilds the op, ``DS_BUILD_<NAME>``) follows from ``NAME``.
    """

    NAME: ClassVar[str]
    BUILD_VAR: ClassVar[str]
    SOURCES: ClassVar[tuple[str, ...]]
    SYMBOLS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "NAME" in cls.__dict__ and "BUILD_VAR" not in cls.__dict__:
            cls.BUILD_VAR = f"DS_BUILD_{cls.NAME.upper()}"

    def __init__(self, simd_level: str | None = None) -> None:
        self.simd_level = simd_level or _cpu.best_simd_level()
        if self.simd_level not in _cpu.SIMD_LEVELS:
            raise ValueError(f"simd_level={simd_level!r} is unknown; accepted: {', '.join(_cpu.SIMD_LEVELS)}")

    # ---- toolchain probes (DeepSpeed's static methods; clients branch on them) ----------------------
    @staticmethod
    def is_rocm_pytorch() -> bool:
        """Whether this torch is a ROCm (HIP) build."""
        import torch

        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        """``(major, minor)`` of the ROCm torch was built with; ``(0, 0)`` for a CUDA or CPU build."""
        import torch

        hip = getattr(torch.version, "hip", None)
        if not hip:
            return (0, 0)
        major, minor, *_ = [*hip.split("."), "0", "0"]
        return (int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0))

    @staticmethod
    def installed_cuda_version() -> tuple[int, int]:
        """``(major, minor)`` of the CUDA torch was built with; ``(0, 0)`` for a CPU or ROCm build."""
        import torch

        cuda = torch.version.cuda
        if not cuda:
            return (0, 0)
        major, minor, *_ = [*cuda.split("."), "0"]
        return (int(major), int(minor))

    # ---- identity -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """DeepSpeed's builders carry their ``NAME`` as ``name`` too."""
        return self.NAME

    def absolute_name(self) -> str:
        return f"ds_ops.op_builder.{self.NAME}"

    def sources(self) -> list[Path]:
        return [CSRC_DIR / s for s in (*self.SOURCES, "common.cpp")]

    def cxx_flags(self) -> list[str]:
        return [*_BASE_FLAGS, *_cpu.simd_flags(self.simd_level)]

    def ld_flags(self) -> list[str]:
        return ["-fopenmp"]

    def include_paths(self) -> list[Path]:
        return [CSRC_DIR]

    def cxx_args(self) -> list[str]:  # DeepSpeed's name
        return self.cxx_flags()

    def extra_ldflags(self) -> list[str]:  # DeepSpeed's name
        return self.ld_flags()

    def content_key(self) -> str:
        """Hash of sources, headers, flags and the CPU features the build assumes (no compiler)."""
        h = hashlib.sha256()
        h.update(f"{self.NAME}|abi{ABI_VERSION}|{_cpu.simd_feature_key(self.simd_level)}".encode())
        h.update(" ".join(self.cxx_flags() + self.ld_flags()).encode())
        for path in sorted({*self.sources(), *CSRC_DIR.glob("*.h")}):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        return h.hexdigest()

    def cache_key(self) -> str:
        """content_key plus the compiler binary and torch version: one JIT build directory per key."""
        import torch

        extra = f"{self.content_key()}|{toolchain.compiler_identity()}|torch{torch.__version__}"
        return hashlib.sha256(extra.encode()).hexdigest()[:24]

    def build_dir(self) -> Path:
        return cache_root() / self.NAME / f"{self.simd_level}-{self.cache_key()}"

    def library_path(self) -> Path:
        return self.build_dir() / f"{self.NAME}.so"

    def prebuilt_path(self) -> Path | None:
        """The library shipped in the wheel for this level, when its manifest matches these sources."""
        lib = PREBUILT_DIR / f"{self.NAME}-{self.simd_level}.so"
        manifest = lib.with_suffix(".json")
        if not (lib.is_file() and manifest.is_file()):
            return None
        try:
            meta = json.loads(manifest.read_text())
        except (OSError, ValueError):
            return None
        return lib if meta.get("content_key") == self.content_key() else None

    # ---- status ---------------------------------------------------------------------------------
    def compatibility_problems(self) -> list[str]:
        """Why this op cannot be built and run here (empty when it can)."""
        problems = []
        missing = _cpu.missing_features(self.simd_level)
        if missing:
            problems.append(
                f"this CPU ({_cpu.cpu_model()}) lacks {', '.join(missing)} needed by simd level "
                f"{self.simd_level!r}; set {_cpu.SIMD_ENV} to one of {', '.join(_cpu.supported_simd_levels())}."
            )
        if self.prebuilt_path() is None and not self.library_path().is_file():
            problems += toolchain.toolchain_problems()
        return problems

    def is_compatible(self, verbose: bool = False) -> bool:
        problems = self.compatibility_problems()
        if verbose and problems:
            print(f"[ds_ops] {self.NAME} is not compatible: " + " ".join(problems))
        return not problems

    def is_built(self) -> str | None:
        """'prebuilt' or 'cached' when a library for this key exists, else None."""
        if self.prebuilt_path() is not None:
            return "prebuilt"
        return "cached" if self.library_path().is_file() else None

    # ---- load / build ---------------------------------------------------------------------------
    def load(self, verbose: bool = False) -> ctypes.CDLL:
        """The loaded library: from this process, the wheel, the JIT cache, or a fresh build."""
        key = f"{self.NAME}:{self.simd_level}"
        with _loaded_lock:
            if key in _loaded:
                return _loaded[key]
            missing = _cpu.missing_features(self.simd_level)
            if missing:
                raise OpBuildError(f"cannot load op {self.NAME!r}: " + self.compatibility_problems()[0])
            path = self.prebuilt_path() or self.library_path()
            if not path.is_file():
                path = self.jit_build(verbose=verbose)
            _loaded[key] = self._open(path)
            return _loaded[key]

    def jit_load(self, verbose: bool = False) -> ctypes.CDLL:
        """DeepSpeed's name for loading through the JIT path: the same library as :meth:`load`."""
        return self.load(verbose=verbose)

    def jit_build(self, verbose: bool = False) -> Path:
        """Compile into the cache under a file lock; a concurrent builder's result is reused."""
        final = self.build_dir()
        lock = final.parent / f"{final.name}.lock"
        try:
            with file_lock(lock):
                if (final / f"{self.NAME}.so").is_file():
                    return final / f"{self.NAME}.so"
                problems = toolchain.toolchain_problems() or [
                    p for p in [toolchain.probe_compile(tuple(self.cxx_flags()))] if p
                ]
                if problems:
                    raise OpBuildError(
                        f"cannot build op {self.NAME!r}: " + " ".join(problems) + self._fallback_hint()
                    )
                for stale in final.parent.glob(f"{final.name}.tmp*"):  # left by a builder that died; we hold the lock
                    shutil.rmtree(stale, ignore_errors=True)
                staging = final.parent / f"{final.name}.tmp{os.getpid()}"
                self.build_into(staging, verbose=verbose)
                staging.rename(final)
        except LockTimeout as exc:
            raise OpBuildError(str(exc)) from exc
        return final / f"{self.NAME}.so"

    def build_into(self, directory: Path, verbose: bool = False) -> Path:
        """Compile with torch.utils.cpp_extension (ninja) into ``directory``; returns the library path."""
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            produced = cpp_extension.load(
                name=self.NAME,
                sources=[str(s) for s in self.sources()],
                extra_cflags=self.cxx_flags(),
                extra_ldflags=self.ld_flags(),
                build_directory=str(directory),
                verbose=verbose,
                with_cuda=False,
                is_python_module=False,
            )
        except (RuntimeError, OSError, SystemExit) as exc:
            raise OpBuildError(
                f"compiling op {self.NAME!r} in {directory} failed: {exc}\n"
                f"Compiler: {toolchain.compiler()}; flags: {' '.join(self.cxx_flags())}." + self._fallback_hint()
            ) from exc
        lib = directory / f"{self.NAME}.so"
        if Path(produced) != lib:  # cpp_extension renames repeat builds of one name in a process (NAME_v1.so)
            Path(produced).replace(lib)
        (directory / "build_info.json").write_text(
            json.dumps(
                {
                    "name": self.NAME,
                    "simd_level": self.simd_level,
                    "content_key": self.content_key(),
                    "flags": self.cxx_flags(),
                    "seconds": round(time.perf_counter() - start, 2),
                },
                indent=1,
            )
        )
        return lib

    def _open(self, path: Path) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path))
        for symbol in (*self.SYMBOLS, "ds_ops_simd_level", "ds_ops_abi_version"):
            if not hasattr(lib, symbol):
                raise OpBuildError(f"{path} lacks entry point {symbol}; delete {path.parent} to rebuild it.")
        lib.ds_ops_simd_level.restype = ctypes.c_char_p
        built_level = lib.ds_ops_simd_level().decode()
        if lib.ds_ops_abi_version() != ABI_VERSION or built_level != self.simd_level:
            raise OpBuildError(
                f"{path} was built for abi {lib.ds_ops_abi_version()} / {built_level}, expected "
                f"{ABI_VERSION} / {self.simd_level}; delete {path.parent} to rebuild it."
            )
        return lib

    @staticmethod
    def _fallback_hint() -> str:
        return (
            " To train without the native op, construct the optimizer with allow_torch_fallback=True "
            "(or set DS_OPS_ALLOW_TORCH_FALLBACK=1) to use a slower pure-torch implementation."
        )

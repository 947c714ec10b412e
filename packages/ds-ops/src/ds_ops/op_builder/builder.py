"""``deepspeed.ops.op_builder.builder`` (``ds_ops.op_builder.builder``): DeepSpeed's op-builder base module:
``OpBuilder`` (the builder class, with its toolchain probes) and the CUDA-toolkit checks scripts run before
building CUDA extensions."""

from __future__ import annotations

import os
import re
import subprocess
import warnings

import torch

from ds_ops.op_builder._builder import OpBuilder, OpBuildError

__all__ = ["CUDAMismatchException", "MissingCUDAException", "OpBuildError", "OpBuilder", "assert_no_cuda_mismatch",
           "installed_cuda_version"]


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

"""``deepspeed.git_version_info``: DeepSpeed's record of what this install is and which ops it has.

``version`` is the DeepSpeed API version this release serves (``deepspeed.__about__``, the one place it is set);
``git_hash`` / ``git_branch`` name the commit when the package runs from a git checkout of this project, else
``"unknown"`` (what DeepSpeed's setup.py writes without git). These three cost no torch import.

``installed_ops``, ``compatible_ops`` ({op name: bool}, from ds-ops' builder registry, the one ``ds_report``
lists), ``torch_info`` (DeepSpeed's keys: ``version``, ``bf16_support``, ``cuda_version``, ``nccl_version``,
``hip_version``; ``"0.0"`` where a backend is absent) and ``accelerator_name`` are computed on first access,
once per process: DeepSpeed records them at build time, but nothing is built here, so they describe the
running environment. Reading ``torch_info`` on a CUDA machine initialises CUDA (for ``bf16_support``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from deepspeed.__about__ import __version__ as version

_UNKNOWN = "unknown"


def _git(*args: str) -> str:
    """Output of ``git rev-parse`` in this project's checkout, or "unknown" (installed from a wheel, no git)."""
    package = Path(__file__).resolve().parent
    root = package.parents[3]  # <root>/packages/deepspeed/src/deepspeed
    if package != root / "packages" / "deepspeed" / "src" / "deepspeed" or not (root / ".git").exists():
        return _UNKNOWN
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", *args], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return _UNKNOWN
    text = out.stdout.strip()
    return text if out.returncode == 0 and text else _UNKNOWN


git_hash = _git("--short", "HEAD")
git_branch = _git("--abbrev-ref", "HEAD")


def _major_minor(text: str | None) -> str:
    return ".".join(text.split(".")[:2]) if text else "0.0"


def _torch_info() -> dict[str, Any]:
    import torch

    cuda = torch.version.cuda
    nccl = "0.0"
    if cuda:
        try:
            raw = torch.cuda.nccl.version()
            nccl = ".".join(map(str, raw[:2])) if isinstance(raw, tuple) else _major_minor(str(raw))
        except (RuntimeError, AttributeError):  # a CUDA build without NCCL
            pass
    return {
        "version": _major_minor(torch.__version__),
        "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
        "cuda_version": _major_minor(cuda),
        "nccl_version": nccl,
        "hip_version": _major_minor(getattr(torch.version, "hip", None)),
    }


def _op_tables() -> dict[str, Any]:
    from ds_ops.op_builder import op_tables

    installed, compatible = op_tables()
    return {"installed_ops": installed, "compatible_ops": compatible}


def _accelerator_name() -> dict[str, Any]:
    from deepspeed.accelerator import get_accelerator

    return {"accelerator_name": get_accelerator()._name}


_COMPUTED = {
    "installed_ops": _op_tables,
    "compatible_ops": _op_tables,
    "torch_info": lambda: {"torch_info": _torch_info()},
    "accelerator_name": _accelerator_name,
}

__all__ = ["git_branch", "git_hash", "version", *_COMPUTED]


def __getattr__(name: str) -> Any:
    if name not in _COMPUTED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals().update(_COMPUTED[name]())
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_COMPUTED))

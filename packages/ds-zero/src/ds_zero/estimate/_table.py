"""Rows of a memory estimate, the checks on the estimators' inputs, and the printed table layout.

Both ZeRO stages share this so their tables look the same: a three-line header (what is estimated, the
hardware, the model size) and one line per option combination with the bytes per CPU (i.e. per node) and
per GPU, shown in GiB (2**30 bytes) with two decimals, as DeepSpeed prints them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from numbers import Integral, Real

GIB = 2**30  # the tables' "GB" are binary gigabytes


@dataclass(frozen=True)
class EstimateRow:
    """One option combination of an estimate.

    ``cpu_mem`` is bytes of general RAM needed on each node, ``gpu_mem`` bytes needed on each GPU (model
    states only: params, gradients, optimizer states; no activations). ``offload_param`` and ``zero_init``
    are ``None`` for ZeRO-2, where they do not apply.
    """

    stage: int
    cpu_mem: float
    gpu_mem: float
    offload_optimizer: str
    offload_param: str | None = None
    zero_init: bool | None = None

    @property
    def cpu_gb(self) -> float:
        """Bytes per CPU in GiB."""
        return self.cpu_mem / GIB

    @property
    def gpu_gb(self) -> float:
        """Bytes per GPU in GiB."""
        return self.gpu_mem / GIB

    @property
    def options(self) -> str:
        """The Options column, spelled as in the documented tables."""
        if self.stage == 2:
            # The documented ZeRO-2 table spells the no-offload case with a capital N.
            return f"offload_optimizer={'cpu' if self.offload_optimizer == 'cpu' else 'None'}"
        return (f"offload_param={self.offload_param:4}, offload_optimizer={self.offload_optimizer:4}, "
                f"zero_init={int(bool(self.zero_init))}")

    def as_dict(self) -> dict:
        """Plain dict (for JSON output), with the GiB figures and the options text added."""
        out = asdict(self)
        out.update(cpu_gb=self.cpu_gb, gpu_gb=self.gpu_gb, options=self.options)
        return out


def check_count(name: str, value: object) -> float:
    """A parameter count: a finite real number >= 0 (``2851e6`` is accepted, as in the documented calls)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number of parameters (int or float), got {value!r} "
                        f"of type {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """A GPU or node count: an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def check_buffer_factor(value: object) -> float:
    """The safety factor applied to CPU memory: a finite real number > 0 (documented default 1.5)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"additional_buffer_factor must be a finite number > 0, got {value!r}")
    return value


def check_largest_layer(largest_layer_params: object, total_params: float) -> float:
    """The largest layer's parameter count: a count no bigger than the model's total."""
    largest = check_count("largest_layer_params", largest_layer_params)
    if largest > total_params:
        raise ValueError(f"largest_layer_params ({largest_layer_params!r}) cannot exceed total_params "
                         f"({total_params!r})")
    return largest


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def render_table(rows: list[EstimateRow], total_params: float, num_gpus_per_node: int, num_nodes: int,
                 largest_layer_params: float | None = None) -> str:
    """The text the ``*_all_live`` / ``*_all_cold`` estimators print (no trailing newline).

    Model sizes are shown in whole millions, truncated (2,851,598,336 params print as ``2851M``).
    """
    software = f"SW: Model with {int(total_params / 1e6)}M total params"
    if largest_layer_params is not None:
        software += f", {int(largest_layer_params / 1e6)}M largest layer params"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {_plural(num_nodes, 'node')}, {_plural(num_gpus_per_node, 'GPU')} per node.",
        software + ".",
        f"{'per CPU':>11} | {'per GPU':>9} | Options",
    ]
    lines += [f"{row.cpu_gb:9.2f}GB | {row.gpu_gb:7.2f}GB | {row.options}" for row in rows]
    return "\n".join(lines)

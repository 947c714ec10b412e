"""Per-rank memory accounting of a live ZeRO stage 1/2 optimizer (bytes of the tensors it holds), and the
theoretical figures of the ZeRO paper to compare with.

Shared by ``test_zero_memory.py`` and ``benchmarks/zero_memory.py``. Bytes are counted once per storage, so a
view (the model's parameters are views of the flat low-precision buffer; ``lp_partition`` is a view of it too)
is never counted twice. Ψ is the number of trainable elements (unpadded); N the data-parallel world size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ZeroMemory:
    """Bytes held by one rank, by role. ``buckets``: reducer buffers allocated at the time of the count."""

    psi: int
    world: int
    lp_bytes_per_element: int
    master: int
    optimizer_state: int
    grad_partitions: int
    lp_params: int
    full_grads: int
    buckets: int

    @property
    def model_states(self) -> int:
        """Masters + optimizer states + gradient partitions + low-precision weights + full local gradients."""
        return self.master + self.optimizer_state + self.grad_partitions + self.lp_params + self.full_grads

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model_states": self.model_states}


class _Storages:
    """Adds a tensor's storage bytes once, however many views of it are seen."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def bytes(self, tensors: Any) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def account(opt: Any) -> ZeroMemory:
    """Count what ``opt`` (a ``ds_zero`` ``DeepSpeedZeroOptimizer``) holds on this rank right now.

    Order matters only for shared storages: each storage is attributed to the first role that holds it
    (masters, optimizer state, gradient partitions, weights, full gradients, buckets)."""
    seen = _Storages()
    groups = opt.groups
    master = seen.bytes(fg.master for fg in groups)
    state = seen.bytes(_state_tensors(opt.optimizer))
    grad_parts = seen.bytes(fg.grad_partition for fg in groups if fg.grad_partition_allocated)
    lp = seen.bytes(fg.lp_flat for fg in groups)
    params = [p for fg in groups for p in fg.params]
    full = seen.bytes(opt.get_grad(p) for p in params)
    buckets = seen.bytes(opt.reducer.buffers())
    psi = sum(p.numel() for p in params)
    size = params[0].element_size() if params else 4
    return ZeroMemory(psi=psi, world=opt.world, lp_bytes_per_element=size, master=master, optimizer_state=state,
                      grad_partitions=grad_parts, lp_params=lp, full_grads=full, buckets=buckets)


def theoretical_bytes(stage: int, psi: int, world: int, lp_bytes_per_element: int, state_bytes: int = 8) -> float:
    """The ZeRO paper's per-rank model-state bytes for Adam (two fp32 states: ``state_bytes`` = 8 per element)
    with K = 4 + ``state_bytes`` bytes of fp32 master + states per element partitioned:
    stage 1: kΨ weights + kΨ gradients + KΨ/N; stage 2: kΨ weights + (k + K)Ψ/N, k = the model dtype's size.
    Mixed precision (k = 2): 4Ψ + 12Ψ/N and 2Ψ + 14Ψ/N; fp32 (k = 4): 8Ψ + 12Ψ/N and 4Ψ + 16Ψ/N."""
    if stage not in (1, 2):
        raise ValueError(f"theoretical_bytes: stage must be 1 or 2, got {stage}")
    if world < 1 or psi < 0:
        raise ValueError(f"theoretical_bytes: need world >= 1 and psi >= 0, got world={world}, psi={psi}")
    k, partitioned = lp_bytes_per_element, 4 + state_bytes
    if stage == 1:
        return 2 * k * psi + partitioned * psi / world
    return k * psi + (k + partitioned) * psi / world


def bucket_allowance_bytes(opt: Any) -> int:
    """What the reduction and gather buckets may add on top of the theory: one ``reduce_bucket_size`` bucket
    (two with ``overlap_comm``, one being filled while the other is reduced) in the communication dtype, plus
    one ``allgather_bucket_size`` chunk of the model dtype, each capped at the whole model."""
    psi = sum(p.numel() for fg in opt.groups for p in fg.params)
    reduce = opt.settings.reduce
    comm_size = max(torch.finfo(b.dtype).bits // 8 for b in opt.reducer.buckets) if opt.reducer.buckets else 4
    lp_size = opt.groups[0].lp_flat.element_size() if opt.groups else 4
    reduce_buckets = (2 if reduce.overlap_comm else 1) * min(reduce.bucket_numel, psi) * comm_size
    return reduce_buckets + min(opt.settings.allgather_bucket_numel, psi) * lp_size

"""The collectives ZeRO issues, behind one narrow interface.

ds-zero installs and runs alone, so by default it calls ``torch.distributed`` itself. The engine hands it
``deepspeed.comm`` instead, whose functions have the same signatures: then ZeRO's reductions and gathers
show in the ``comms_logger`` and a failed or timed-out one names its op, rank and call number, as stage 0's
all-reduce does.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist


class Collectives(Protocol):
    def all_reduce(self, tensor: torch.Tensor, op: Any = ..., group: Any = None, async_op: bool = False) -> Any: ...

    def reduce(self, tensor: torch.Tensor, dst: int, op: Any = ..., group: Any = None,
               async_op: bool = False) -> Any: ...

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any: ...

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                               async_op: bool = False) -> Any: ...

    def batch_isend_irecv(self, p2p_op_list: list[dist.P2POp]) -> list[Any]: ...


class TorchCollectives:
    """``torch.distributed`` as it is (the flat all-gather under its torch 2.13 name where it exists)."""

    all_reduce = staticmethod(dist.all_reduce)
    reduce = staticmethod(dist.reduce)
    broadcast = staticmethod(dist.broadcast)
    all_gather_into_tensor = staticmethod(getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)
    batch_isend_irecv = staticmethod(dist.batch_isend_irecv)


TORCH = TorchCollectives()

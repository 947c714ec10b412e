"""What the 1-bit optimizers share: their base class (process group, parameter walk, restored step), the backend
note, flat error-feedback buffers, momentum masks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.runtime.comm.compressed import BLOCK, compressed_allreduce, error_sizes

TORCH_BACKENDS = ("nccl", "hccl", "gloo", "torch")


def check_backend(name: str, optimizer: str) -> None:
    """``comm_backend_name``: nccl/hccl use torch.distributed (as here); mpi / compressed need DeepSpeed's MPI or
    CuPy backends, which this version does not have: say so and use torch.distributed collectives instead."""
    if str(name).lower() in TORCH_BACKENDS:
        return
    from deepspeed.utils import logger

    logger.warning(f"{optimizer}: comm_backend_name={name!r} (MPI / compressed NCCL via mpi4py or CuPy) is not "
                   "available in this version; the compressed all-reduce runs over torch.distributed collectives "
                   "of the process group's own backend (gloo on CPU, NCCL on GPU) instead")


class CompressedComm:
    """A flat compressed average over ``group`` of one list of same-device fp32 tensors, with its error buffers
    kept in ``state`` (the optimizer state of the first parameter, so they are in ``state_dict``)."""

    def __init__(self, state: dict[str, Any], block: int = BLOCK) -> None:
        self.state = state
        self.block = block

    def errors(self, numel: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        padded, chunk = error_sizes(numel, world, self.block)
        worker, server = self.state.get("worker_error"), self.state.get("server_error")
        if worker is None or worker.numel() != padded or server is None or server.numel() != chunk:
            worker = torch.zeros(padded, dtype=torch.float32, device=device)  # first use or another world size
            server = torch.zeros(chunk, dtype=torch.float32, device=device)
            self.state["worker_error"], self.state["server_error"] = worker, server
        return worker, server

    def average_(self, tensors: list[torch.Tensor], group: Any) -> None:
        """Replace every tensor of ``tensors`` with its compressed average over ``group`` (in place)."""
        world = dist.get_world_size(group)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        worker, server = self.errors(flat.numel(), world, flat.device)
        averaged = compressed_allreduce(flat, worker, server, group=group, block=self.block)
        offset = 0
        for t in tensors:
            t.copy_(averaged[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def average_full_precision_(tensors: list[torch.Tensor], group: Any, log_name: str) -> None:
    """The plain average over ``group`` (warm-up): one flat fp32 all-reduce."""
    from deepspeed import comm

    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    comm.all_reduce(flat, group=group, log_name=log_name)
    flat.div_(dist.get_world_size(group))
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class OnebitOptimizer(torch.optim.Optimizer):
    """Base of ``OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb``: they communicate themselves (the engine gives
    them no gradient reducer and sets ``comm_group``, the data-parallel group; default: the world)."""

    communicates_gradients = True  # the engine must not all-reduce gradients for these optimizers

    variant = ""  # the name DeepSpeed's messages use ("1-bit Adam")

    def __init__(self, params: Any, defaults: dict[str, Any], *, deepspeed: Any, cuda_aware: bool,
                 comm_backend_name: str, eps_inside_sqrt: bool, amsgrad: bool) -> None:
        if amsgrad:
            raise RuntimeError(f"{self.variant} does not support the AMSGrad variant.")
        super().__init__(params, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.deepspeed = deepspeed
        self.cuda_aware = bool(cuda_aware)
        self.comm_backend_name = comm_backend_name
        check_backend(comm_backend_name, type(self).__name__)
        self.comm_group: Any = None

    def _params(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """(group, param) of every parameter with a gradient; sparse gradients are refused."""
        out = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for _, p in out:
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        return out

    def _head(self) -> dict[str, Any]:
        """The state of the first parameter: it holds the error-feedback buffers and optimizer-wide scalars."""
        return self.state[self.param_groups[0]["params"][0]]

    def _comm(self) -> CompressedComm:
        return CompressedComm(self._head())

    def _restored_step(self) -> int:
        return max((int(s.get("step", 0)) for s in self.state.values()), default=0)

    @staticmethod
    def _closure(closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _keep_masks(self, state_dict: dict[str, Any]) -> None:
        """``exp_avg_mask`` stays the one the client set on the live groups (DeepSpeed: it may change between
        training phases), never the checkpoint's."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=False):
            if "exp_avg_mask" in group:
                saved["exp_avg_mask"] = group["exp_avg_mask"]
            else:
                saved.pop("exp_avg_mask", None)


def apply_mask_(group: dict[str, Any], tensor: torch.Tensor) -> None:
    """Multiply ``tensor`` by the group's ``exp_avg_mask`` if it has one: 1-bit compression cannot send an exact
    zero, so momenta that must stay zero (e.g. unused embedding rows) are masked after each compressed average."""
    mask = group.get("exp_avg_mask")
    if mask is not None:
        if mask.device != tensor.device:
            group["exp_avg_mask"] = mask = mask.to(tensor.device)
        tensor.mul_(mask)

"""How the engine runs a 1-bit optimizer: no gradient reduction of its own (DeepSpeed sets
``enable_backward_allreduce=False``; the optimizer averages in ``step``), the data-parallel group handed to the
optimizer, and each rank's error-feedback buffers saved in its own checkpoint file (they differ per rank;
the model-states file holds rank 0's optimizer state only)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

ONEBIT_CLASSES = ("OnebitAdam", "ZeroOneAdam", "OnebitLamb")
_ERROR_KEYS = ("worker_error", "server_error")


def is_onebit(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "communicates_gradients", False))


class NoGradientReduction:
    """The ``GradientReducer`` of a 1-bit optimizer: gradients stay local; the optimizer communicates."""

    every_micro_step = False

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """Nothing: the optimizer averages (warm-up) or compresses (after ``freeze_step``) in ``step``."""

    def finish(self) -> None:
        """Nothing to wait for."""


def error_file_name(dp_rank: int, mp_rank: int = 0) -> str:
    return f"onebit_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_error_feedback.pt"


class ErrorFeedbackShards:
    """``CheckpointShards``: this rank's ``worker_error``/``server_error`` in its own file, restored after the
    optimizer state (whose copies are rank 0's). A checkpoint without them (or from another world size)
    starts the errors from zero, as DeepSpeed always does on load."""

    owns_optimizer_state = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def _state(self) -> dict[str, Any]:
        return self.optimizer.state[self.optimizer.param_groups[0]["params"][0]]

    def model_state_extras(self) -> Mapping[str, Any]:
        return {}

    def files_to_save(self, ctx: Any) -> Mapping[str, Any]:
        state = self._state()
        errors = {k: state[k].detach().cpu().clone() for k in _ERROR_KEYS if k in state}
        return {error_file_name(ctx.parallel.dp_rank, ctx.parallel.mp_rank): errors}

    def load_files(self, ctx: Any, load: Callable[[str], Any]) -> None:
        if ctx.load_module_only or not ctx.load_optimizer_states:
            return
        state = self._state()
        for key in _ERROR_KEYS:
            state.pop(key, None)  # rank 0's copies from the model-states file
        name = error_file_name(ctx.parallel.dp_rank, ctx.parallel.mp_rank)
        if not os.path.isfile(os.path.join(ctx.tag_dir, name)):
            return
        device = self.optimizer.param_groups[0]["params"][0].device
        for key, value in load(name).items():
            state[key] = value.to(device)


def attach(optimizer: torch.optim.Optimizer, wrapper: Any, dp_group: Any) -> NoGradientReduction:
    """Give ``optimizer`` the data-parallel group, register its checkpoint files on ``wrapper``; the reducer."""
    optimizer.comm_group = dp_group
    wrapper.checkpoint_shards = (*getattr(wrapper, "checkpoint_shards", ()), ErrorFeedbackShards(optimizer))
    return NoGradientReduction()

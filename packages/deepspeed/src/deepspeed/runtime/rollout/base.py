"""The rollout interface: how an RL or on-policy distillation trainer asks for generations.

The trainer hands a ``RolloutRequest`` (left-padded prompts) and a ``SamplingConfig`` to a ``RolloutEngine`` and
gets back a ``RolloutBatch``: prompt and response in one right-padded tensor, with the column where each response
starts. Engines differ in where generation runs (``HybridEngineRollout``: the training engine's own module) and in
whether weights must be pushed to them after each optimizer step (``sync_weights``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

__all__ = ["RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest", "SamplingConfig"]


@dataclass
class RolloutConfig:
    """Which rollout engine ``build_rollout`` builds (``engine``: ``"hybrid_engine"``), and whether its greedy
    decoding runs a static-KV-cache loop captured as a device graph (``use_graph_capture``)."""

    engine: str = "hybrid_engine"
    use_graph_capture: bool = False


@dataclass
class SamplingConfig:
    """Per-call sampling settings. ``temperature <= 0`` is greedy decoding; ``top_k <= 0`` disables top-k;
    ``n_samples_per_prompt`` responses are drawn for each prompt (rows ``i * n`` .. ``i * n + n - 1``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("n_samples_per_prompt", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"SamplingConfig.{name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"SamplingConfig.top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")


def _check_pair(first: torch.Tensor, second: torch.Tensor, names: tuple[str, str], shape_hint: str) -> None:
    if first.dim() != 2:
        raise ValueError(f"{names[0]} must be 2-D {shape_hint}; got {tuple(first.shape)}")
    if second.shape != first.shape:
        raise ValueError(f"{names[1]} shape {tuple(second.shape)} does not match {names[0]} {tuple(first.shape)}")


@dataclass
class RolloutRequest:
    """Prompts for ``RolloutEngine.generate``: ``prompt_ids`` [B, T_p] *left*-padded (real tokens at the right
    edge, so generation appends right after them) and ``prompt_attention_mask`` [B, T_p], 1 on real tokens."""

    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        _check_pair(self.prompt_ids, self.prompt_attention_mask, ("prompt_ids", "prompt_attention_mask"),
                    "[B, T_p]")


@dataclass
class RolloutBatch:
    """What ``RolloutEngine.generate`` returns: ``input_ids`` [B * n, T_p + T_r], each row its left-padded prompt
    followed by its response (right-padded to the longest); ``attention_mask`` the same shape, 1 on real tokens;
    ``response_start_idx`` [B * n], the column where each response starts."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: torch.Tensor

    def __post_init__(self) -> None:
        _check_pair(self.input_ids, self.attention_mask, ("input_ids", "attention_mask"), "[B, T]")
        rows = self.input_ids.shape[0]
        if self.response_start_idx.shape != (rows, ):
            raise ValueError(f"response_start_idx must be 1-D of length {rows}; got "
                             f"{tuple(self.response_start_idx.shape)}")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


class RolloutEngine(ABC):
    """A backend that generates responses for a trainer."""

    name: str = "base"

    @abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Generate ``sampling.n_samples_per_prompt`` responses per prompt; prompt and response in one batch."""

    @abstractmethod
    def sync_weights(self, step: int) -> None:
        """Make the backend generate with the weights of training step ``step`` (nothing to do for a backend
        that shares the training engine's weights)."""

    def shutdown(self) -> None:
        """Release the backend's resources (none by default)."""
        return None

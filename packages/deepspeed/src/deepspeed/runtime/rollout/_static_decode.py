"""Greedy decoding over a preallocated (static) KV cache, optionally replayed as a captured device graph.

Every decode step has the same shapes: one token per row, the full-length attention mask (zeros past the current
position), a one-element cache position. So the step can be captured once as a device graph (CUDA graphs) and
replayed with its inputs updated in place, which removes the per-step kernel-launch cost of small batches. Where
the device has no graphs (the CPU) the same step runs eagerly. Tokens equal Hugging Face ``generate`` with
``do_sample=False`` for a model without extra logits processors: a row that emitted an EOS id gets
``pad_token_id`` after it, and decoding stops early once every row has finished.

Buffers: ``_Step``'s inputs (``token``, ``position``, ``cache_position``, ``mask``) and the cache are read by the
step (or its graph); they are written only between steps, by the decode loop.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

__all__ = ["greedy_decode"]


def _static_cache(module: torch.nn.Module, batch: int, length: int, device: torch.device) -> Any:
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    if "batch_size" in params:  # transformers < 5: the cache is allocated eagerly
        dtype = next(module.parameters()).dtype
        return StaticCache(config=module.config, batch_size=batch, max_cache_len=length, device=device, dtype=dtype)
    return StaticCache(config=module.config, max_cache_len=length)


def _cache_keyword(module: torch.nn.Module) -> str:
    # transformers 5.x renamed the forward's cache argument (past_key_values still works, with a warning)
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class _Step:
    """One decode step of ``module`` on static inputs; captured as a graph when ``capture`` and possible."""

    def __init__(self, module: torch.nn.Module, cache: Any, mask: torch.Tensor, capture: bool) -> None:
        device = mask.device
        self.module, self.mask = module, mask
        self.kwargs = {_cache_keyword(module): cache, "use_cache": True}
        self.token = torch.zeros(mask.shape[0], 1, dtype=torch.long, device=device)
        self.position = torch.zeros(mask.shape[0], 1, dtype=torch.long, device=device)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: Any = None
        self.capture = capture and device.type == "cuda"

    def _run(self) -> torch.Tensor:
        out = self.module(self.token, attention_mask=self.mask, position_ids=self.position,
                          cache_position=self.cache_position, **self.kwargs)
        return out.logits[:, -1, :]

    def _capture(self) -> None:
        cuda = torch.cuda
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):  # warm-up on the first step's inputs: rewrites the same cache slot it will hold
            self._run()
        cuda.current_stream().wait_stream(side)
        graph = cuda.CUDAGraph()
        with cuda.graph(graph):
            self.logits = self._run()
        self.graph = graph

    def __call__(self) -> torch.Tensor:
        if self.capture and self.graph is None:
            try:
                self._capture()
            except RuntimeError as err:  # a model whose forward is not capturable: decode eagerly
                warnings.warn(f"graph capture of the decode step failed ({err}); decoding eagerly", stacklevel=3)
                self.capture, self.graph = False, None
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return self._run()


def greedy_decode(module: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  max_new_tokens: int, pad_token_id: int, eos_token_ids: list[int], capture: bool) -> torch.Tensor:
    """[B, T_p + up to max_new_tokens] token ids: the left-padded prompts and their greedy continuations."""
    batch, prompt_len = prompt_ids.shape
    device = prompt_ids.device
    cache = _static_cache(module, batch, prompt_len + max_new_tokens, device)
    mask = torch.zeros(batch, prompt_len + max_new_tokens, dtype=torch.long, device=device)
    mask[:, :prompt_len] = prompt_mask
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # left padding does not count
    prefill = module(prompt_ids, attention_mask=mask[:, :prompt_len], position_ids=positions,
                     cache_position=torch.arange(prompt_len, device=device), use_cache=True,
                     **{_cache_keyword(module): cache})
    eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    step = _Step(module, cache, mask, capture)
    step.position.copy_(positions[:, -1:])
    logits, tokens = prefill.logits[:, -1, :], []
    for index in range(max_new_tokens):
        token = torch.where(finished, pad_token_id, logits.argmax(-1))
        tokens.append(token)
        finished |= torch.isin(token, eos)
        if index == max_new_tokens - 1 or bool(finished.all()):
            break
        column = prompt_len + index
        step.token.copy_(token.unsqueeze(1))
        step.position.add_(1)
        step.cache_position.fill_(column)
        mask[:, column] = 1
        logits = step()
    return torch.cat([prompt_ids, torch.stack(tokens, dim=1)], dim=1)

"""``HybridEngineRollout``: generation with the training engine's own module (DeepSpeed's hybrid engine).

The weights generation uses are the ones being trained, so ``sync_weights`` has nothing to do. Two paths:
- the module's ``generate`` (Hugging Face), for sampling and greedy decoding. Under the hybrid engine
  (``"hybrid_engine": {"enabled": true}``) ``engine.module.generate`` is the engine's ``generate``, which under
  ZeRO-3 gathers the partitioned weights once for the whole call;
- with ``use_graph_capture`` and greedy decoding (``temperature <= 0``): a static-KV-cache decode loop
  (``_static_decode``) whose step is captured as a CUDA graph and replayed (eager where there are no graphs),
  run inside the hybrid engine's ``gathered_for_generation``.
The module runs in eval mode (no dropout) during generation and gets its previous mode back afterwards.

The returned attention mask is the prompt's mask, then 1 on each response token up to and including its first
EOS token and 0 after it (DeepSpeed marks every pad-token id 0, which drops the EOS itself when pad and EOS are
the same id, as for many Llama tokenizers, so a policy would never be trained to stop).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed.runtime.rollout._static_decode import greedy_decode
from deepspeed.runtime.rollout.base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig"]


@dataclass
class HybridEngineRolloutConfig:
    """``use_graph_capture``: greedy decoding through the static-cache loop, its step captured as a graph."""

    use_graph_capture: bool = False


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class HybridEngineRollout(RolloutEngine):
    """Rollouts from ``engine.module`` (``engine``: a DeepSpeed engine, the hybrid engine for ZeRO-3) with
    ``tokenizer``'s pad and EOS ids; ``cfg``: anything with ``use_graph_capture`` (``RolloutConfig``,
    ``HybridEngineRolloutConfig``) or None."""

    name = "hybrid_engine"

    def __init__(self, engine: Any, tokenizer: Any, cfg: Any = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.use_graph_capture = bool(getattr(cfg, "use_graph_capture", False)) if cfg is not None else False

    # -- ids ---------------------------------------------------------------------------------------------------
    def _pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "eos_token_id", None)
        if pad is None:
            raise ValueError("HybridEngineRollout needs tokenizer.pad_token_id or tokenizer.eos_token_id (the id "
                             "that pads finished responses); the tokenizer has neither")
        return int(pad)

    def _eos_token_ids(self) -> list[int]:
        return _ids(getattr(self.tokenizer, "eos_token_id", None))

    # -- generation --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        n = sampling.n_samples_per_prompt
        prompt_ids, prompt_mask = request.prompt_ids, request.prompt_attention_mask
        if n > 1:  # the n samples of prompt i are rows i*n .. i*n+n-1
            prompt_ids, prompt_mask = prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
        pad = self._pad_token_id()
        module = self.engine.module
        with _eval_mode(module):
            if self.use_graph_capture and sampling.temperature <= 0:
                output_ids = self._generate_graph(prompt_ids, prompt_mask, sampling.max_new_tokens, pad, module,
                                                  prompt_ids.device)
            else:
                eos = self._eos_token_ids()  # the tokenizer's, which the returned mask is built from
                output_ids = module.generate(prompt_ids, attention_mask=prompt_mask, pad_token_id=pad,
                                             max_new_tokens=sampling.max_new_tokens,
                                             **({"eos_token_id": eos} if eos else {}),
                                             **self._sampling_kwargs(sampling))
        prompt_len = prompt_ids.shape[1]
        return RolloutBatch(input_ids=output_ids, attention_mask=self._attention_mask(output_ids, prompt_mask),
                            response_start_idx=torch.full((output_ids.shape[0], ), prompt_len, dtype=torch.long,
                                                          device=output_ids.device))

    @staticmethod
    def _sampling_kwargs(sampling: SamplingConfig) -> dict[str, Any]:
        if sampling.temperature <= 0:
            return {"do_sample": False}
        # top_k=0 switches off the model's default top-k (50 in Hugging Face's generation config)
        return {"do_sample": True, "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                "top_k": max(int(sampling.top_k), 0)}

    def _attention_mask(self, output_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        prompt_len = prompt_mask.shape[1]
        response = output_ids[:, prompt_len:]
        eos = torch.tensor(self._eos_token_ids(), dtype=response.dtype, device=response.device)
        is_eos = torch.isin(response, eos).long()
        after_first_eos = (is_eos.cumsum(1) - is_eos) > 0
        return torch.cat([prompt_mask.to(output_ids.device, torch.long), (~after_first_eos).long()], dim=1)

    def _generate_graph(self, prompt_ids: torch.Tensor, prompt_attn: torch.Tensor, max_new_tokens: int,
                        pad_token_id: int, module: torch.nn.Module, device: torch.device) -> torch.Tensor:
        """Greedy decoding through the static-KV-cache loop, the decode step captured as a graph on CUDA."""
        gathered = getattr(self.engine, "gathered_for_generation", None)
        with gathered() if callable(gathered) else contextlib.nullcontext():
            return greedy_decode(module, prompt_ids.to(device), prompt_attn.to(device), max_new_tokens,
                                 pad_token_id, self._eos_token_ids(), capture=True)

    @staticmethod
    def _sample_top_p(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
        """[B, 1] token ids drawn from ``logits`` [B, V] / ``temperature``, restricted to the smallest set of
        most likely tokens whose probability reaches ``top_p`` (nucleus sampling; ``top_p=1``: all tokens)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling (greedy decoding is temperature <= 0), "
                             f"got {temperature!r}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        logits = logits.float() / temperature
        if top_p < 1.0:
            ordered, order = logits.sort(dim=-1, descending=True)
            probs = ordered.softmax(-1)
            # a token stays while the mass of the tokens before it is below top_p: the first always stays
            dropped = probs.cumsum(-1) - probs >= top_p
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered.masked_fill(dropped,
                                                                                                 float("-inf")))
        return torch.multinomial(logits.softmax(-1), 1)

    def sync_weights(self, step: int) -> None:
        """Nothing to push: generation reads the training engine's weights directly."""
        return None

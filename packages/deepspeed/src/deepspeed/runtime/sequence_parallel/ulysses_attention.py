"""ALST's Ulysses attention for Hugging Face Transformers: ``UlyssesSPAttentionHF``.

Each rank of the sequence-parallel group runs the model on its slice of the sequence. Inside every attention layer
Transformers calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, **kw)`` with
``[bs, heads, s/P, head_dim]`` tensors; ``register_with_transformers`` puts a wrapper under that same key, so every
model-specific branch keyed on the implementation's name still runs. The wrapper exchanges the sequence slice for
a slice of the heads over the whole sequence (the Ulysses all-to-all of ``deepspeed.sequence.layer``), calls the
original attention, and exchanges back, returning ``[bs, s/P, heads * head_dim]``.

Causal masking comes from the positions, not from the mask: the per-shard mask Transformers builds is for the local
length and would be O(s^2) at the full length, so the wrapper drops 4D masks (flex_attention's BlockMask is rebuilt
for the full length) and gathers ``position_ids`` over the group, which the attention back ends use for causality and
packed-sequence boundaries. Key/value heads fewer than the group size are replicated so every rank gets one.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from deepspeed.sequence.layer import sequence_all_to_all
from deepspeed.utils.logging import logger

__all__ = ["UlyssesSPAttentionHF"]

_MIN_TRANSFORMERS = (4, 51, 3)
_HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")  # e.g. kernels-community/flash-attn2


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string ("4.52.0.dev0" -> (4, 52, 0))."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"UlyssesSPAttentionHF: {name} must be a positive integer, got {value!r}")
    return value


class UlyssesSPAttentionHF(torch.nn.Module):
    """The attention wrapper (see the module docstring). ``attn`` is the core attention function taken from
    ``transformers``' ``ALL_ATTENTION_FUNCTIONS``; ``seq_length_is_variable=False`` fixes the lengths
    (``local_seq_length``, ``global_seq_length``) and checks every call against them. ``disable_in_eval`` bypasses
    the exchange while ``module`` is in eval mode (then each rank attends over what it holds).
    ``skip_all_but_last_attention_debug_mode`` (attribute) runs only every ``num_hidden_layers``-th core attention
    and passes queries through otherwise: a memory-fitting aid whose results are meaningless."""

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        have = importlib.metadata.version("transformers")
        if _release(have) < _MIN_TRANSFORMERS:
            raise ValueError(f"UlyssesSPAttentionHF needs transformers>={'.'.join(map(str, _MIN_TRANSFORMERS))}, "
                             f"found {have}")
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.attn_head_count = _positive_int(attn_head_count, "attn_head_count")
        self.attn_head_size = _positive_int(attn_head_size, "attn_head_size")
        self.global_kv_head_count = _positive_int(kv_head_count, "kv_head_count")
        self.num_hidden_layers = _positive_int(num_hidden_layers, "num_hidden_layers")
        self.seq_length_is_variable = seq_length_is_variable
        self.disable_in_eval = disable_in_eval
        self.skip_all_but_last_attention_debug_mode = False
        self.rotating_layer_counter = 0
        self.core_attn_implementation: str | None = None  # set by register_with_transformers
        self._block_mask: tuple[tuple[int, int], Any] | None = None  # ((batch, seq), BlockMask) for flex_attention
        world = self.world_size
        if attn_head_count % world:
            raise ValueError(f"UlyssesSPAttentionHF: attn_head_count ({attn_head_count}) must be divisible by the "
                             f"sequence parallel size ({world})")
        if kv_head_count % world and world % kv_head_count:
            raise ValueError(f"UlyssesSPAttentionHF: kv_head_count ({kv_head_count}) and the sequence parallel size "
                             f"({world}) must divide one another")
        # fewer key/value heads than ranks: each is replicated so that every rank receives exactly one
        self.kv_replication_factor = max(1, world // kv_head_count)
        self.local_q_head_count = attn_head_count // world
        self.local_kv_head_count = max(1, kv_head_count // world)
        if not seq_length_is_variable:
            if local_seq_length is None or global_seq_length is None:
                raise ValueError("UlyssesSPAttentionHF: local_seq_length and global_seq_length are required when "
                                 "seq_length_is_variable is False")
            if local_seq_length * world != global_seq_length:
                raise ValueError(f"UlyssesSPAttentionHF: global_seq_length ({global_seq_length}) must be "
                                 f"local_seq_length ({local_seq_length}) times the sequence parallel size ({world})")
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length

    # ---- the exchange ------------------------------------------------------------------------------------------
    def _to_heads(self, t: Tensor, replicate: int) -> Tensor:
        """``[bs, H, s/P, d]`` -> ``[bs, H/P (or 1), s, d]``."""
        if replicate > 1:
            t = t.repeat_interleave(replicate, dim=1)
        return sequence_all_to_all(t.transpose(1, 2), 1, self.process_group, to_heads=True).transpose(1, 2)

    def _gather_positions(self, position_ids: Tensor) -> Tensor:
        parts = [torch.empty_like(position_ids) for _ in range(self.world_size)]
        dist.all_gather(parts, position_ids.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=-1)

    def _check_shapes(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        want_q = (self.batch_size, self.attn_head_count, self.local_seq_length, self.attn_head_size)
        want_kv = (self.batch_size, self.global_kv_head_count, self.local_seq_length, self.attn_head_size)
        if tuple(query.shape) != want_q or tuple(key.shape) != want_kv or tuple(value.shape) != want_kv:
            raise ValueError(f"UlyssesSPAttentionHF (rank {self.sp_rank}): expected query {want_q} and key/value "
                             f"{want_kv} ([bs, heads, local seq, head_dim]), got query {tuple(query.shape)}, key "
                             f"{tuple(key.shape)}, value {tuple(value.shape)}")

    def _full_length_block_mask(self, mask: Any, query: Tensor) -> Any:
        """flex_attention's BlockMask was built for the local length: a causal one for the full length (cached)."""
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask
        if not isinstance(mask, BlockMask):
            return mask
        key = (query.shape[0], query.shape[2])
        if self._block_mask is None or self._block_mask[0] != key:
            block = create_block_mask(lambda b, h, q, kv: q >= kv, B=key[0], H=None, Q_LEN=key[1], KV_LEN=key[1],
                                      device=query.device)
            self._block_mask = (key, block)
        return self._block_mask[1]

    def forward(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        """``[bs, heads, s/P, d]`` query/key/value of this rank's slice -> (``[bs, s/P, heads * d]``, weights)."""
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if self.seq_length_is_variable:
            self.local_seq_length = query.shape[2]
            self.global_seq_length = self.local_seq_length * self.world_size
        self._check_shapes(query, key, value)
        if kwargs.get("position_ids") is None:
            raise ValueError("UlyssesSPAttentionHF: every forward needs position_ids (torch.arange(seq_len) per "
                             "sample, reset at document boundaries for packed samples): attention causality over "
                             "the gathered sequence comes from them. UlyssesSPDataLoaderAdapter requires them in "
                             "each batch and shards them with the inputs")
        kwargs["position_ids"] = self._gather_positions(kwargs["position_ids"])
        q = self._to_heads(query, 1)
        k = self._to_heads(key, self.kv_replication_factor)
        v = self._to_heads(value, self.kv_replication_factor)
        if self.kv_replication_factor > 1:
            module.num_key_value_groups = q.shape[1] // k.shape[1]  # the model's GQA repeat for the local heads
        if self.core_attn_implementation == "flex_attention":
            attention_mask = self._full_length_block_mask(attention_mask, q)
        context, weights = self._core(module, q, k, v, attention_mask, *args, **kwargs)
        want = (q.shape[0], self.global_seq_length, self.local_q_head_count, self.attn_head_size)
        if tuple(context.shape) != want:
            raise ValueError(f"UlyssesSPAttentionHF: the core attention returned {tuple(context.shape)}; expected "
                             f"{want} ([bs, seq, local heads, head_dim])")
        out = sequence_all_to_all(context, 1, self.process_group, to_heads=False)  # [bs, s/P, heads, d]
        return out.reshape(out.shape[0], out.shape[1], -1), weights

    def _core(self, module: torch.nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: Any, *args: Any,
              **kwargs: Any) -> tuple[Tensor, Any]:
        if self.skip_all_but_last_attention_debug_mode:
            self.rotating_layer_counter = (self.rotating_layer_counter + 1) % self.num_hidden_layers
            if self.rotating_layer_counter != 0:
                return q.transpose(1, 2), None
        return self.attn(module, q, k, v, mask, *args, **kwargs)

    # ---- Transformers integration ------------------------------------------------------------------------------
    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Route ``core_attn_implementation`` through Ulysses for every model of this process; returns the mpu
        (``deepspeed.runtime.sequence_parallel.parallel_state_sp``, pass it to ``deepspeed.initialize``), or None
        when ``sequence_parallel_size`` is 1. ``model_name_or_path``: a model (or anything with ``.config``), a
        hub name or a local path. ``max_length`` is the deprecated name of ``seq_length``."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("register_with_transformers: max_length is deprecated, use seq_length")
            seq_length = max_length if seq_length is None else seq_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: seq_length is required when seq_length_is_variable is False")
        config = _model_config(model_name_or_path)
        attn_fn = _core_attention(config, core_attn_implementation)
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
        mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
        world = mpu.get_sequence_parallel_world_size()
        if not seq_length_is_variable and seq_length % world:
            raise ValueError(f"register_with_transformers: seq_length ({seq_length}) must be divisible by "
                             f"sequence_parallel_size ({world})")
        text = config.get_text_config()
        uattn = cls(attn=attn_fn, batch_size=micro_batch_size, attn_head_count=text.num_attention_heads,
                    attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                    kv_head_count=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                    num_hidden_layers=text.num_hidden_layers, process_group=mpu.get_sequence_parallel_group(),
                    seq_length_is_variable=seq_length_is_variable,
                    local_seq_length=None if seq_length_is_variable else seq_length // world,
                    global_seq_length=None if seq_length_is_variable else seq_length,
                    disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                              *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
            if not _is_block_mask(attention_mask):  # a mask for the local length is wrong after the exchange
                attention_mask = None
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        return mpu


def _is_block_mask(mask: Any) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # a torch without flex attention has no BlockMask to keep
        return False
    return isinstance(mask, BlockMask)


def _model_config(model_name_or_path: Any) -> Any:
    if hasattr(model_name_or_path, "config"):  # a model, or a wrapper (PEFT) exposing its config
        return model_name_or_path.config
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_name_or_path)


def _core_attention(config: Any, name: str) -> Any:
    """The attention function registered under ``name``, after checking it can run under Ulysses."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    configured = getattr(config, "_attn_implementation", None)
    if configured is not None and configured != name:
        raise ValueError(f"register_with_transformers: core_attn_implementation={name!r} does not match model "
                         f"config attn_implementation={configured!r}; set both to the same value so the "
                         f"sequence-parallel wrapper sits on the attention the model calls")
    if name in ("eager", "paged|eager"):
        raise ValueError(f"register_with_transformers: core_attn_implementation={name!r} is not supported: it needs "
                         f"a 4D attention mask (O(seq^2) memory) that sequence parallelism drops; use 'sdpa', "
                         f"'flex_attention', a flash attention variant or a hub kernel")
    if isinstance(name, str) and _HUB_KERNEL.match(name):
        from transformers.modeling_flash_attention_utils import lazy_import_flash_attention
        lazy_import_flash_attention(name)
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"register_with_transformers: core_attn_implementation={name!r} is not a registered "
                         f"attention; choices: {ALL_ATTENTION_FUNCTIONS.valid_keys()}")
    return ALL_ATTENTION_FUNCTIONS[name]

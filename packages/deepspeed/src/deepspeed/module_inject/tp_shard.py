"""``deepspeed.module_inject.tp_shard``: how AutoTP splits one dimension over a tensor-parallel group, with the
model facts DeepSpeed keeps as module state (``set_num_kv_heads``, ``set_tp_grain_size``, ...).

A width that is a whole number of key/value heads (attention projections) is split by heads, the first
``num_kv_heads % mp_size`` ranks taking one head more; MLP, MoE-expert and output-head widths (and everything when
the head count is unknown) are split in multiples of ``tp_grain_size`` with the remainder on the last rank, or
near-evenly when smaller than one grain. Ranks are group-local (``[0, mp_size)``).
"""

from __future__ import annotations

from typing import Any

from deepspeed import comm as dist
from ds_inference.autotp.split_rules import ModelFacts, rank_size, set_model_facts_source

num_kv_heads: int | None = None
num_attention_heads: int | None = None
n_embd: int | None = None
tp_grain_size: int = 1


def set_num_kv_heads(num: int | None) -> None:
    global num_kv_heads
    num_kv_heads = num


def set_num_attention_heads(num: int | None) -> None:
    global num_attention_heads
    num_attention_heads = num


def set_n_embd(num: int | None) -> None:
    global n_embd
    n_embd = num


def set_tp_grain_size(num: int) -> None:
    global tp_grain_size
    if not isinstance(num, int) or isinstance(num, bool) or num < 1:
        raise ValueError(f"set_tp_grain_size: num={num!r}; accepted: a positive int (elements per grain)")
    tp_grain_size = num


def get_num_kv_heads() -> int | None:
    return num_kv_heads


def get_num_attention_heads() -> int | None:
    return num_attention_heads


def get_n_embd() -> int | None:
    return n_embd


def _group_rank(mp_size: int, mp_group: Any) -> int:
    if mp_group is not None:
        return dist.get_rank(group=mp_group)
    world = dist.get_world_size()
    if world != mp_size:
        raise ValueError(f"get_shard_size needs a group-local rank or process group (rank=, mp_group=) when "
                         f"mp_size ({mp_size}) differs from the world size ({world})")
    return dist.get_rank()


def get_shard_size(total_size: int, mp_size: int, name: Any = None, rank: int | None = None, mp_group: Any = None,
                   num_kv_heads: int | None = None) -> int:
    """Elements of a ``total_size``-long dimension on tensor-parallel rank ``rank`` (group-local); ``num_kv_heads``
    overrides the module's head count (to split fused Q/K/V pieces by their own head counts)."""
    if rank is None:
        rank = _group_rank(mp_size, mp_group)
    return rank_size(total_size, mp_size, rank, name, num_kv_heads, _facts())


def get_shard_size_list(total_size: int, mp_size: int, name: Any = None,
                        num_kv_heads: int | None = None) -> list[int]:
    """``get_shard_size`` for every rank of the group (sums to ``total_size``)."""
    return [get_shard_size(total_size, mp_size, name, rank, num_kv_heads=num_kv_heads) for rank in range(mp_size)]


def _facts() -> ModelFacts:
    return ModelFacts(num_kv_heads, num_attention_heads, n_embd, tp_grain_size)


# AutoTP layers built by hand (deepspeed.module_inject.layers) split by these facts, as DeepSpeed's read this module
set_model_facts_source(_facts)

"""Which global ranks form each expert-parallel (EP) and expert-data-parallel (EDP) group: pure arithmetic.

An EP group holds one copy of every expert, split ``num_experts / ep_size`` per rank (tokens move between
its ranks by all-to-all); an EDP group holds the ranks that own the same experts (their gradients are
averaged over it). Layouts follow DeepSpeed's ``deepspeed.utils.groups``:

- E + D (default), world 16, ep 2: EP ``[0,1] [2,3] ... [14,15]``, EDP ``[0,2,...,14] [1,3,...,15]``.
- D + E (``use_data_before_expert_parallel_``), world 16, ep 2: EP ``[0,8] [1,9] ...``, EDP
  ``[0..7] [8..15]``.
- Pipeline stages (``pp_size``) are contiguous blocks of ``world / pp`` ranks; groups stay inside a stage.
- With model parallelism (``mp_size > 1``) in ``"tp"`` mode a stage's ranks are reordered TP-lane-major
  before chunking into EP groups (``"sp"``: kept consecutive); EDP groups take the same position of each.
- The ``mpu`` variant (:func:`expert_parallel_ranks_with_mpu`), world 16, tp 2, ep 4:
  EP ``[0,2,4,6] [8,10,12,14] [1,3,5,7] [9,11,13,15]``, EDP ``[0,8] [2,10] [4,12] [6,14] [1,9] ...``.
"""

from __future__ import annotations

MP_MODES = ("tp", "sp")


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _stage_stride(world_size: int, ep_size: int, pp_size: int) -> int:
    """Ranks per pipeline stage, checked to be a whole multiple of ``ep_size``."""
    _check_positive(world_size=world_size, ep_size=ep_size, pp_size=pp_size)
    if world_size % pp_size:
        raise ValueError(f"pipeline parallel size {pp_size} does not divide world size {world_size}")
    stride = world_size // pp_size
    if stride % ep_size:
        where = f"world size {world_size}" if pp_size == 1 else \
            f"the {stride} ranks of a pipeline stage (world size {world_size}, pipeline parallel size {pp_size})"
        raise ValueError(f"expert parallel size ep_size={ep_size} does not divide {where}")
    return stride


def _legacy_layout(world_size: int, ep_size: int, stride: int, data_before: bool) -> tuple[list, list]:
    ep_stride = stride // ep_size
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    for start in range(0, world_size, stride):
        for i in range(ep_size):
            edp = range(start + i * ep_stride, start + (i + 1) * ep_stride) if data_before \
                else range(start + i, start + stride, ep_size)
            edp_groups.append(list(edp))
        if data_before:
            ep_groups.extend(list(range(start + i, start + stride, ep_stride)) for i in range(ep_stride))
    if not data_before:
        ep_groups = [list(range(i * ep_size, (i + 1) * ep_size)) for i in range(world_size // ep_size)]
    return ep_groups, edp_groups


def expert_and_data_parallel_ranks(world_size: int, ep_size: int, pp_size: int = 1, mp_size: int = 1,
                                   mp_mode: str = "tp", use_data_before_expert_parallel_: bool = False,
                                   ) -> tuple[list[list[int]], list[list[int]]]:
    """``(ep_groups, edp_groups)`` as DeepSpeed's ``_create_expert_and_data_parallel`` builds them."""
    stride = _stage_stride(world_size, ep_size, pp_size)
    _check_positive(mp_size=mp_size)
    if mp_size <= 1:
        return _legacy_layout(world_size, ep_size, stride, use_data_before_expert_parallel_)
    if use_data_before_expert_parallel_:
        raise ValueError(f"use_data_before_expert_parallel_=True with mp_size={mp_size}: DeepSpeed's data-before-"
                         "expert layout exists without model parallelism only; accepted: False, or mp_size 1")
    if mp_mode not in MP_MODES:
        raise ValueError(f"mp_mode must be one of {MP_MODES}, got {mp_mode!r}")
    if stride % mp_size:
        raise ValueError(f"model parallel size {mp_size} does not divide the {stride} ranks of a pipeline stage")
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    for start in range(0, world_size, stride):
        stage = list(range(start, start + stride))
        if mp_mode == "tp":
            stage = [stage[g * mp_size + lane] for lane in range(mp_size) for g in range(stride // mp_size)]
        chunks = [stage[g:g + ep_size] for g in range(0, stride, ep_size)]
        ep_groups.extend(chunks)
        edp_groups.extend([chunk[pos] for chunk in chunks] for pos in range(ep_size))
    return ep_groups, edp_groups


def expert_parallel_ranks_with_mpu(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                                   pipeline_parallel_size_: int = 1, use_data_before_expert_parallel_: bool = False,
                                   ) -> tuple[list[list[int]], list[list[int]]]:
    """``(ep_groups, edp_groups)`` of DeepSpeed's ``_get_expert_parallel_ranks`` (E + M + D with an mpu)."""
    tp, ep, pp = tensor_parallel_size_, expert_parallel_size_, pipeline_parallel_size_
    _check_positive(world_size=world_size, tensor_parallel_size_=tp, expert_parallel_size_=ep,
                    pipeline_parallel_size_=pp)
    if world_size % (tp * pp):
        raise ValueError(f"tensor ({tp}) x pipeline ({pp}) parallel size does not divide world size {world_size}")
    dp_world_size = world_size // (tp * pp)
    if dp_world_size % ep:
        raise ValueError(f"expert parallel size ep_size={ep} does not divide data parallel size {dp_world_size} "
                         f"(world size {world_size}, tensor parallel {tp}, pipeline parallel {pp})")
    pp_stride = world_size // pp
    dp_groups: list[list[int]] = []
    for start in range(0, world_size, pp_stride):
        for i in range(tp):
            if use_data_before_expert_parallel_:
                dp_stride = world_size // ep // tp // pp
                dp_groups.append([r for ds in range(dp_stride)
                                  for r in range(start + i + ds * tp, start + pp_stride, dp_stride * tp)])
            else:
                dp_groups.append(list(range(start + i, start + pp_stride, tp)))
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    for dp_ranks in dp_groups:
        parts = [dp_ranks[i:i + ep] for i in range(0, dp_world_size, ep)]
        ep_groups.extend(parts)
        edp_groups.extend(list(ranks) for ranks in zip(*parts, strict=True))
    return ep_groups, edp_groups

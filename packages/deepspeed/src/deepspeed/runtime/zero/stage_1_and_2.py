"""``deepspeed.runtime.zero.stage_1_and_2``: ZeRO stage 1/2's optimizer at DeepSpeed's module path.

ds-zero's :class:`~ds_zero.stage_1_and_2.DeepSpeedZeroOptimizer` does the work (its own bucketed reducer, see
``ds_zero._reduce``). This subclass, the one the engine builds, adds the bucket-reduction entry points
DeepSpeed's optimizer offers to callers (``allreduce_bucket``, ``allreduce_and_copy``, ``allreduce_no_retain``,
``buffered_reduce_fallback``, ``allreduce_and_scatter``, ``average_tensor``, ...), which need the accelerator's
streams and so live here, beside ``deepspeed.comm`` and ``get_accelerator`` (both looked up through this
module at call time, as in DeepSpeed).

Streams: with ``overlap_comm`` on a device that does not order work by itself
(``get_accelerator().resolves_data_dependency()`` false) the reductions run on ``reduction_stream``. A reduced
buffer and every gradient it is copied back into are then recorded on that stream, so the caching allocator does
not hand their memory to another tensor before the stream's copies finish; ``average_tensor`` makes the reduction
stream wait for every stream that copied gradients into the bucket (``IPGBucket.copy_streams``; the current
stream when none did). On the CPU all of this is ordinary sequential work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from ds_moe.autoep import folding as _folding
from ds_moe.autoep.folded import FOLDING_HOOKED_ATTR
from ds_moe.autoep.folding import AUTOEP_FOLDING_GRAD_REDUCE_SKIP
from ds_zero import stage_1_and_2 as _zero
from ds_zero.stage_1_and_2 import (
    GroupComm,
    ReduceSettings,
    ZeroSettings,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_to_params,
)

__all__ = ["AllgatherBucketSizeError", "DeepSpeedZeroOptimizer", "GroupComm", "IPGBucket", "ReduceSettings",
           "ZeroSettings",
           "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero2_model_states_mem_needs_all_live", "get_accelerator", "model_to_params"]


def apply_folding_correction_to_grad_buffer(folding_spec: Any, param: torch.nn.Parameter, grad: torch.Tensor, *,
                                            tp_group: Any, param_name: str | None = None,
                                            use_correction_marker: bool = True) -> str:
    """``ds_moe.autoep.folding``'s correction over ``deepspeed.comm`` (the collectives DeepSpeed's code uses)."""
    return _folding.apply_folding_correction_to_grad_buffer(folding_spec, param, grad, tp_group=tp_group,
                                                            param_name=param_name,
                                                            use_correction_marker=use_correction_marker, comm=dist)


@dataclass
class IPGBucket:
    """One communication dtype's bucket of gradients waiting to be reduced: ``buffer`` (contiguous buffers the
    gradients are copied into; ``index`` the one being filled), ``params`` (``(group index, index in the group,
    parameter id)`` per gradient, in bucket order), ``grads``, ``elements`` filled so far, ``has_moe_params``,
    and ``copy_streams``: the streams that copied into the buffer since the last reduction, which the reduction
    must wait for."""

    buffer: list[torch.Tensor] = field(default_factory=list)
    params: list[tuple[int, int, int]] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    elements: int = 0
    index: int = 0
    has_moe_params: bool = False
    copy_streams: set = field(default_factory=set)

    def clear(self) -> None:
        """Forget the reduced gradients (the buffers stay, to be refilled)."""
        self.params.clear()
        self.grads.clear()
        self.elements = 0
        self.has_moe_params = False
        self.copy_streams.clear()


class AllgatherBucketSizeError(ValueError, AssertionError):
    """``zero_optimization.allgather_bucket_size`` is not a multiple of ``nccl_start_alignment_factor``: a
    ``ValueError`` naming the key, and the ``AssertionError`` DeepSpeed's optimizer raises for it."""


def _check_allgather_bucket(settings: ZeroSettings, factor: int) -> None:
    # gathered chunks start at multiples of the bucket size: an odd one would start a 16-bit chunk mid-word
    size = settings.allgather_bucket_numel
    if size % factor:
        raise AllgatherBucketSizeError(
            f"zero_optimization.allgather_bucket_size: allgather_bucket_size must be a multiple of "
            f"nccl_start_alignment_factor ({factor}: the 16-bit elements in the 4 bytes collectives align "
            f"buffers to); got {size}")


def _on_stream(optimizer: Any) -> bool:
    """Whether reduced buffers must be recorded on the reduction stream (see the module docstring)."""
    return optimizer.overlap_comm and not get_accelerator().resolves_data_dependency()


class DeepSpeedZeroOptimizer(_zero.DeepSpeedZeroOptimizer):
    """ZeRO stage 1/2 optimizer (see ds-zero's class) with DeepSpeed's bucket-reduction methods."""

    nccl_start_alignment_factor = 2  # DeepSpeed's name: partitions start on 4 bytes of 16-bit elements
    autoep_folding_spec: Any = None  # AutoEP folded onto AutoTP: its layout and tensor-parallel group
    autoep_folding_tp_group: Any = None

    def __init__(self, init_optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                 names: dict[torch.nn.Parameter, str], settings: ZeroSettings, *args: Any, **kwargs: Any) -> None:
        _check_allgather_bucket(settings, self.nccl_start_alignment_factor)
        super().__init__(init_optimizer, params, names, settings, *args, **kwargs)
        r = self.settings.reduce
        self.overlap_comm = r.overlap_comm
        self.reduce_scatter = r.reduce_scatter
        self.use_multi_rank_bucket_allreduce = r.use_multi_rank_bucket_allreduce
        self.reduce_bucket_size = r.bucket_numel
        self.gradient_average = r.average
        self.postscale_gradients = not r.prescale_gradients
        self.gradient_predivide_factor = r.gradient_predivide_factor
        self.sequence_parallel_size = 1
        self.dp_process_group = self.dp_group
        self.previous_reduced_grads: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        self.ipg_buckets: dict[torch.dtype, IPGBucket] = {}
        accel = get_accelerator()
        self.reduction_stream = None if accel.is_synchronized_device() else accel.Stream()

    def _maybe_reduce_autoep_folding_tp_gradient(self, param: torch.nn.Parameter, grad: torch.Tensor | None) -> Any:
        """DeepSpeed's per-gradient hook point for AutoEP+AutoTP folding: the correction of ``grad`` (see
        ``ds_moe.autoep.folding``) where the gradient leaves this optimizer's hands here: ZeRO-2 (reduced into
        partitions; each micro-batch's gradient corrected, no once-per-step marker) and ZeRO-1 with
        ``overlap_comm`` (reduced as it arrives; corrected once). ZeRO-1 without overlap keeps full gradients
        until the engine's boundary sweep, which owns the correction; an incomplete gradient (``ds_grad_is_ready``
        False) is left alone. Gradients of a folded model are already corrected by its backward hooks."""
        if self.autoep_folding_spec is None or grad is None or getattr(param, "ds_grad_is_ready", True) is False:
            return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
        if getattr(param, FOLDING_HOOKED_ATTR, False):  # its backward hook corrected it: again would divide twice
            return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
        if not self.partition_gradients and not self.overlap_comm:
            return AUTOEP_FOLDING_GRAD_REDUCE_SKIP
        return apply_folding_correction_to_grad_buffer(self.autoep_folding_spec, param, grad,
                                                       tp_group=self.autoep_folding_tp_group,
                                                       use_correction_marker=not self.partition_gradients)

    @property
    def partition_gradients(self) -> bool:
        """Whether gradients are reduced into partitions (stage 2); assignable, as DeepSpeed's attribute is."""
        pinned = self.__dict__.get("_partition_gradients")
        return super().partition_gradients if pinned is None else pinned

    @partition_gradients.setter
    def partition_gradients(self, value: bool) -> None:
        self.__dict__["_partition_gradients"] = bool(value)

    @property
    def parallel_partitioned_bit16_groups(self) -> list[list[torch.Tensor]]:
        """DeepSpeed's name, per parameter group: every data-parallel rank's partition of the flat 16-bit weights
        (views of ``bit16_groups_flat``, each starting a multiple of ``2 * nccl_start_alignment_factor`` bytes
        into it, as the flat layout pads to ``nccl_start_alignment_factor * world_size`` elements)."""
        out = []
        for fg in self.groups:
            ranges = [fg.layout.partition_range(r) for r in range(fg.layout.world_size)]
            out.append([fg.lp_flat[start:end] for start, end in ranges])
        return out

    @staticmethod
    def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
        return _flatten_dense_tensors(tensors)

    @staticmethod
    def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return _unflatten_dense_tensors(flat, tensors)

    def _divisor(self, process_group: Any) -> float:
        return dist.get_world_size(group=process_group) / float(self.sequence_parallel_size)

    def gradient_reduction_w_predivide(self, tensor: torch.Tensor, communication_data_type: torch.dtype):
        """All-reduce ``tensor`` in place over the data-parallel group, averaged as the config says
        (``prescale_gradients`` divides before the sum, otherwise ``gradient_predivide_factor`` splits the
        division around it)."""
        if tensor.numel() == 0:
            return tensor
        work = tensor if communication_data_type == tensor.dtype else tensor.to(communication_data_type)
        divisor = self._divisor(self.dp_process_group)
        if not self.gradient_average:
            dist.all_reduce(work, group=self.dp_process_group)
        elif self.postscale_gradients:
            if self.gradient_predivide_factor != 1.0:
                work.mul_(1.0 / self.gradient_predivide_factor)
            dist.all_reduce(work, group=self.dp_process_group)
            if self.gradient_predivide_factor != divisor:
                work.mul_(self.gradient_predivide_factor / divisor)
        else:
            work.div_(divisor)
            dist.all_reduce(work, group=self.dp_process_group)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def allreduce_bucket(self, bucket: list[torch.Tensor], communication_data_type: torch.dtype,
                         rank: int | None = None, log: Any = None, divide: bool = True,
                         process_group: Any = None) -> torch.Tensor:
        """The sum (the mean with ``divide``) of ``bucket``'s tensors across the group, as one flat tensor:
        all-reduced, or reduced to group rank ``rank`` (only that rank's result is meaningful)."""
        process_group = self.dp_process_group if process_group is None else process_group
        tensor = self.flatten(bucket)
        work = tensor if communication_data_type == tensor.dtype else tensor.to(communication_data_type)
        if divide and self.gradient_average:
            work.div_(self._divisor(process_group))
        if rank is None:
            dist.all_reduce(work, group=process_group)
        else:
            # (None: the default group, whose ranks are the global ones)
            root = rank if process_group is None else dist.get_global_rank(process_group, rank)
            dist.reduce(work, root, group=process_group)
        if work is not tensor and (rank is None or rank == dist.get_rank(group=process_group)):
            tensor.copy_(work)
        return tensor

    def _clear_previous_reduced_grads(self) -> None:
        for params in self.previous_reduced_grads.values():
            for param in params:
                param.grad = None
            params.clear()

    def allreduce_and_copy(self, small_bucket: list[torch.Tensor], communication_data_type: torch.dtype,
                           rank: int | None = None, log: Any = None, divide: bool = True,
                           process_group: Any = None) -> None:
        """Reduce ``small_bucket`` (see ``allreduce_bucket``) and write the result back into its tensors (on
        ``rank`` only when one is given)."""
        process_group = self.dp_process_group if process_group is None else process_group
        if self.overlap_comm:
            if not get_accelerator().resolves_data_dependency():
                get_accelerator().synchronize()
            self._clear_previous_reduced_grads()  # their reductions have finished: safe to free
            stream = self.reduction_stream
        else:
            stream = get_accelerator().current_stream()
        recorded = _on_stream(self)
        with get_accelerator().stream(stream):
            reduced = self.allreduce_bucket(small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                                            process_group=process_group)
            if recorded:
                reduced.record_stream(stream)
            if rank is None or rank == dist.get_rank(group=self.dp_process_group):
                for buf, synced in zip(small_bucket, self.unflatten(reduced, small_bucket), strict=True):
                    buf.copy_(synced)
                    if recorded:
                        buf.record_stream(stream)

    def allreduce_no_retain(self, bucket: list[torch.Tensor], communication_data_type: torch.dtype,
                            numel_per_bucket: int = 500000000, rank: int | None = None, log: Any = None,
                            divide: bool = True, process_group: Any = None) -> None:
        """``allreduce_and_copy`` over ``bucket`` in pieces of a little over ``numel_per_bucket`` elements."""
        for piece in _pieces(bucket, numel_per_bucket):
            self.allreduce_and_copy(piece, communication_data_type, rank=rank, log=log, divide=divide,
                                    process_group=process_group)

    def buffered_reduce_fallback(self, rank: int | None, grads: list[torch.Tensor],
                                 communication_data_type: torch.dtype, elements_per_buffer: int = 500000000,
                                 log: Any = None) -> None:
        """Reduce ``grads`` in place, one run of ``allreduce_no_retain`` per tensor dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for bucket in by_dtype.values():
            self.allreduce_no_retain(bucket, communication_data_type, numel_per_bucket=elements_per_buffer,
                                     rank=rank, log=log)

    def allreduce_and_copy_with_multiple_ranks(self, small_bucket: list[torch.Tensor],
                                               communication_data_type: torch.dtype, log: Any = None,
                                               divide: bool = True, process_group: Any = None,
                                               bucket_ranks: list[Any] | None = None) -> None:
        """All-reduce ``small_bucket`` and copy each tensor's result back only on the rank(s) that consume it
        (``bucket_ranks``, aligned with the bucket: a group rank, or a frozenset of them)."""
        process_group = self.dp_process_group if process_group is None else process_group
        if bucket_ranks is None or len(bucket_ranks) != len(small_bucket):
            raise ValueError(f"allreduce_and_copy_with_multiple_ranks: bucket_ranks must name the consumer of each of "
                             f"the {len(small_bucket)} tensors; got {bucket_ranks!r}")
        reduced = self.allreduce_bucket(small_bucket, communication_data_type, log=log, divide=divide,
                                        process_group=process_group)
        recorded = _on_stream(self)
        if recorded:
            reduced.record_stream(self.reduction_stream)
        me = dist.get_rank(group=process_group)
        for buf, synced, consumer in zip(small_bucket, self.unflatten(reduced, small_bucket), bucket_ranks,
                                         strict=True):
            consumes = me in consumer if isinstance(consumer, frozenset) else me == consumer
            if consumes:
                buf.copy_(synced)
                if recorded:
                    buf.record_stream(self.reduction_stream)

    def allreduce_and_scatter(self, bucket: list[tuple[Any, torch.Tensor]], communication_data_type: torch.dtype,
                              numel_per_bucket: int = 500000000, log: Any = None, divide: bool = True,
                              process_group: Any = None) -> None:
        """``allreduce_and_copy_with_multiple_ranks`` over ``(consumer, tensor)`` pairs, in pieces."""
        for piece in _pieces(bucket, numel_per_bucket, numel=lambda pair: pair[1].numel()):
            self.allreduce_and_copy_with_multiple_ranks([t for _, t in piece], communication_data_type,
                                                        divide=divide, process_group=process_group,
                                                        bucket_ranks=[r for r, _ in piece])

    def average_tensor(self, tensor: torch.Tensor, communication_data_type: torch.dtype) -> None:
        """Average ``tensor``, the gradients of ``ipg_buckets[communication_data_type].params`` packed back to
        back, across the data-parallel ranks: all of it (``reduce_scatter`` false), or each rank's slices
        reduced to the rank whose partition holds them (the others' slices are left as they were)."""
        if self.overlap_comm:
            stream = self.reduction_stream
            if not get_accelerator().resolves_data_dependency():
                bucket = self.ipg_buckets.get(communication_data_type)
                producers = (bucket.copy_streams if bucket is not None else None) or \
                    {get_accelerator().current_stream()}
                for producer in producers:
                    stream.wait_stream(producer)
                get_accelerator().current_stream().wait_stream(stream)
        else:
            stream = get_accelerator().current_stream()
        with get_accelerator().stream(stream):
            if not self.reduce_scatter:
                self.gradient_reduction_w_predivide(tensor, communication_data_type)
                return
            self._reduce_to_owners(tensor, communication_data_type)

    def _owner_slices(self, communication_data_type: torch.dtype) -> list[tuple[int, int, int, Any]]:
        """``(owner, offset in the packed tensor, numel, process group)`` runs of the bucket's gradients, adjacent
        pieces with the same owner and group merged."""
        runs: list[tuple[int, int, int, Any]] = []
        offset = 0
        for group_index, index, _ in self.ipg_buckets[communication_data_type].params:
            fg = self.groups[group_index]
            for owner, frag in fg.layout.owners(index):
                start = offset + frag.tensor_offset
                if runs and runs[-1][0] == owner and runs[-1][3] is fg.process_group and \
                        runs[-1][1] + runs[-1][2] == start:
                    runs[-1] = (owner, runs[-1][1], runs[-1][2] + frag.numel, fg.process_group)
                else:
                    runs.append((owner, start, frag.numel, fg.process_group))
            offset += fg.layout.numels[index]
        return runs

    def _reduce_to_owners(self, tensor: torch.Tensor, communication_data_type: torch.dtype) -> None:
        if self.gradient_average:
            tensor.div_(self._divisor(self.dp_process_group))
        plan: dict[tuple, list[Any]] = {}
        for owner, start, numel, group in self._owner_slices(communication_data_type):
            piece = tensor.narrow(0, start, numel)
            if self.use_multi_rank_bucket_allreduce:
                plan.setdefault(("allreduce", group), []).append((owner, piece))
            else:
                plan.setdefault(("reduce", owner, group), []).append(piece)
        for key, pieces in plan.items():
            if key[0] == "allreduce":
                self.allreduce_and_scatter(pieces, communication_data_type, numel_per_bucket=self.reduce_bucket_size,
                                           divide=False, process_group=key[1])
            else:
                self.allreduce_no_retain(pieces, communication_data_type, numel_per_bucket=self.reduce_bucket_size,
                                         rank=key[1], divide=False, process_group=key[2])


def _pieces(items: list[Any], numel_per_bucket: int, numel: Any = torch.Tensor.numel) -> list[list[Any]]:
    """``items`` cut into runs each closed once it holds more than ``numel_per_bucket`` elements."""
    out: list[list[Any]] = []
    run: list[Any] = []
    count = 0
    for item in items:
        run.append(item)
        count += numel(item)
        if count > numel_per_bucket:
            out.append(run)
            run, count = [], 0
    if run:
        out.append(run)
    return out

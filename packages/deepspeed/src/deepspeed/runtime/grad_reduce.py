"""Data-parallel gradient averaging (``GradientReducer``): bucketed and overlapped, plus a plain reference.

Both apply DeepSpeed's options the same way: the communication dtype (``communication_data_type``, else
fp32 with ``fp32_allreduce``, else the ``torch_autocast`` dtype for gradients of its lower-precision-safe
modules, else the gradient's own dtype); ``prescale_gradients`` divides by the world size before the
sum, otherwise gradients are divided by ``gradient_predivide_factor`` before and multiplied by
``factor / world_size`` after it.

``BucketedAllReduce`` packs gradients into fixed buckets (reverse parameter order, the order backward
produces them, about ``bucket_bytes`` each) and starts a bucket's asynchronous all-reduce as soon as all its
gradients have landed, so communication overlaps the rest of backward. Buckets are fixed at construction
and launched strictly in order, so every rank issues the same collectives in the same order.
``ReferenceAllReduce`` all-reduces each gradient on its own after backward: slow and obviously right.

Gradients become bucket views (as DDP's ``gradient_as_bucket_view``): where the optimizer wrapper keeps gradients
in ``param.grad`` (``grads_in_params``) in the communication dtype, the gradient hook copies autograd's fresh
gradient into the bucket and points ``param.grad`` at that slice, so autograd's tensor is freed at once (and its
memory reused by the next layer's) and nothing is copied back after the all-reduce. Kept until ``zero_grad`` and
then freed together, 25 MB of gradients went back to the OS every step and came back as ~6,000 page faults on a
6.3M-parameter MLP (2x DDP's step time on a loaded machine). Later micro-steps accumulate into the view.
Ownership: between a bucket's launch and ``finish``'s wait, gloo's thread owns ``bucket.flat`` (and so those
``param.grad`` views); backward never writes them then (a second gradient for a sent bucket is an error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepspeed import comm
from deepspeed.runtime.optimizer_wrapper import OptimizerWrapper

FIRST_BUCKET_BYTES = 1 << 20  # a small first bucket starts communication early, as DDP does
BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class ReduceOptions:
    """The gradient-communication options of the config, resolved per parameter by ``comm_dtype``."""

    world_size: int
    group: Any = None
    communication_data_type: torch.dtype | None = None
    fp32_allreduce: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    autocast_dtype_of: dict[torch.nn.Parameter, torch.dtype] = field(default_factory=dict)
    average: bool = True
    """False: ``gradient_allreduce_op`` is ``sum``, the plain sum over the ranks (no factor before or after)."""

    def comm_dtype(self, param: torch.nn.Parameter, grad_dtype: torch.dtype) -> torch.dtype:
        if self.communication_data_type is not None:
            return self.communication_data_type
        if self.fp32_allreduce:
            return torch.float32
        return self.autocast_dtype_of.get(param, grad_dtype)

    @property
    def pre_factor(self) -> float:
        """Multiplier applied before the sum."""
        if not self.average:
            return 1.0
        if self.prescale_gradients:
            return 1.0 / self.world_size
        return 1.0 / self.gradient_predivide_factor

    @property
    def post_factor(self) -> float:
        """Multiplier applied after the sum."""
        if not self.average or self.prescale_gradients:
            return 1.0
        return self.gradient_predivide_factor / self.world_size


def _is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return not grad.is_sparse and grad.data_ptr() == view.data_ptr() and grad.numel() == view.numel()


def _write_back(wrapper: OptimizerWrapper, param: torch.nn.Parameter, reduced: torch.Tensor) -> None:
    """Store the averaged gradient where the wrapper keeps ``param``'s (sparse gradients stay sparse)."""
    grad = wrapper.get_grad(param)
    if grad is not None and _is_view_of(grad, reduced):  # the gradient is the bucket's slice: already there
        return
    if grad is not None and grad.is_sparse:
        wrapper.set_grad(param, reduced.view(param.shape).to(grad.dtype).to_sparse())
    elif grad is None:
        wrapper.set_grad(param, reduced.view(param.shape).to(wrapper.grad_dtype(param)).clone())
    else:
        grad.copy_(reduced.view(grad.shape))


class ReferenceAllReduce:
    """One blocking all-reduce per gradient after backward (the reference ``BucketedAllReduce`` must match)."""

    every_micro_step = False

    def __init__(self, params: list[torch.nn.Parameter], wrapper: OptimizerWrapper, options: ReduceOptions) -> None:
        self.params = params
        self.wrapper = wrapper
        self.options = options

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """Nothing happens until ``finish``."""

    def finish(self) -> None:
        opts = self.options
        for p in self.params:
            grad = self.wrapper.get_grad(p)
            dtype = opts.comm_dtype(p, self.wrapper.grad_dtype(p))
            if grad is None:
                buf = torch.zeros(p.shape, dtype=dtype, device=p.device)
            else:  # sparse (nn.Embedding(sparse=True)) gradients are averaged dense
                buf = (grad.to_dense() if grad.is_sparse else grad).to(dtype, copy=True)
            buf.mul_(opts.pre_factor)
            comm.all_reduce(buf, group=opts.group)
            buf.mul_(opts.post_factor)
            _write_back(self.wrapper, p, buf)


class _Bucket:
    """A flat communication buffer and the parameters whose gradients it carries (with their offsets)."""

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype, device: torch.device) -> None:
        self.params = params
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.flat = torch.zeros(offset, dtype=dtype, device=device)
        self.ready: set[int] = set()
        self.work: Any = None

    def slice(self, i: int) -> torch.Tensor:
        return self.flat.narrow(0, self.offsets[i], self.params[i].numel())


def _plan_buckets(params: list[torch.nn.Parameter], wrapper: OptimizerWrapper,
                  options: ReduceOptions, bucket_bytes: int) -> list[_Bucket]:
    """Fixed buckets over ``params`` in reverse order, split by (comm dtype, device) and size."""
    buckets: list[_Bucket] = []
    open_: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    cap = min(FIRST_BUCKET_BYTES, bucket_bytes)
    for p in reversed(params):
        dtype = options.comm_dtype(p, wrapper.grad_dtype(p))
        key = (dtype, p.device)
        open_.setdefault(key, []).append(p)
        sizes[key] = sizes.get(key, 0) + p.numel() * torch.finfo(dtype).bits // 8
        if sizes[key] >= cap:
            buckets.append(_Bucket(open_.pop(key), dtype, p.device))
            sizes.pop(key)
            cap = bucket_bytes
    for (dtype, device), members in open_.items():
        buckets.append(_Bucket(members, dtype, device))
    return buckets


class BucketedAllReduce:
    """Overlapped, bucketed gradient averaging (see the module docstring)."""

    every_micro_step = False

    def __init__(self, params: list[torch.nn.Parameter], wrapper: OptimizerWrapper, options: ReduceOptions,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.wrapper = wrapper
        self.options = options
        self.buckets = _plan_buckets(params, wrapper, options, bucket_bytes)
        self.where = {p: (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self.next_launch = 0

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """Copy ``param``'s gradient into its bucket; launch every bucket that is complete, in order."""
        b, i = self.where[param]
        if b < self.next_launch:  # its bucket is already on the wire: the sum would silently miss this gradient
            raise RuntimeError(f"a gradient of a parameter of shape {tuple(param.shape)} arrived twice in one "
                               "backward pass after it was sent for all-reduce (a parameter used both inside and "
                               "outside reentrant activation checkpointing?); use use_reentrant=False")
        bucket = self.buckets[b]
        self._fill(bucket, i)
        bucket.ready.add(i)
        while self.next_launch < len(self.buckets):
            nxt = self.buckets[self.next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self.next_launch += 1

    def _fill(self, bucket: _Bucket, i: int) -> None:
        param, target = bucket.params[i], bucket.slice(i)
        grad = self.wrapper.get_grad(param)
        if grad is None:
            target.zero_()
        elif not _is_view_of(grad, target):
            target.copy_((grad.to_dense() if grad.is_sparse else grad).reshape(-1))
            if (getattr(self.wrapper, "grads_in_params", False) and grad is param.grad and not grad.is_sparse
                    and grad.dtype == target.dtype and param.is_contiguous()):
                param.grad = target.view(param.shape)  # autograd's own tensor is freed now, not at zero_grad

    def _launch(self, bucket: _Bucket) -> None:
        if self.options.pre_factor != 1.0:
            bucket.flat.mul_(self.options.pre_factor)
        bucket.work = comm.all_reduce(bucket.flat, group=self.options.group, async_op=True)

    def finish(self) -> None:
        """Launch what is left, wait, write back. A parameter whose hook did not fire in this backward (unused
        in it) contributes the gradient it accumulated earlier, or zeros."""
        for bucket in self.buckets[self.next_launch:]:
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    self._fill(bucket, i)
            self._launch(bucket)
        post = self.options.post_factor
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            if post != 1.0:
                bucket.flat.mul_(post)
            for i, p in enumerate(bucket.params):
                _write_back(self.wrapper, p, bucket.slice(i))
            bucket.ready.clear()
        self.next_launch = 0


class GroupedReducer:
    """One reducer per process group, behind one ``GradientReducer``: MoE expert parameters average over their
    expert-data-parallel group (divided by the whole data-parallel size, as DeepSpeed does, so gradients do not
    depend on ``ep_size``), the rest over the data-parallel group."""

    def __init__(self, reducers: list[tuple[list[torch.nn.Parameter], Any]]) -> None:
        self.reducers = [reducer for _, reducer in reducers]
        self.owner = {p: reducer for params, reducer in reducers for p in params}
        self.every_micro_step = any(r.every_micro_step for r in self.reducers)

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        self.owner[param].grad_ready(param)

    def finish(self) -> None:
        for reducer in self.reducers:
            reducer.finish()

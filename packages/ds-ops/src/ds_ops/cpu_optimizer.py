"""Shared driver of the native CPU optimizers: state handling, dtype buckets, the fused copy, state_dict.

Subclasses name their state tensors and provide the per-group hyper-parameters for the kernel and
the pure-torch update used when the fallback is active.
"""

from __future__ import annotations

import itertools
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch

from ds_ops._native import DTYPE_CODES, NO_COPY, load_kernel
from ds_ops.op_builder import OpBuilder
from ds_ops.validate import check_group

# One parameter's work for a step: param, grad, state tensors, copy target (or None), 1-based step.
Item = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], "torch.Tensor | None", int]


class CPUOptimizer(torch.optim.Optimizer):
    """Base for DeepSpeedCPUAdam / Adagrad / Lion: in-place updates of contiguous CPU tensors."""

    STATE_NAMES: ClassVar[tuple[str, ...]]
    STATE_ALIASES: ClassVar[dict[str, str]] = {}  # other optimizers' state names -> ours, for load_state_dict
    BUILDER: ClassVar[type[OpBuilder]]
    SYMBOL: ClassVar[str]

    def __init__(self, params: Iterable, defaults: dict[str, Any], fp32_optimizer_states: bool,
                 allow_torch_fallback: bool | None) -> None:
        check_group(type(self).__name__, defaults)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        super().__init__(params, defaults)
        # Resolved at construction so a missing compiler is reported here, not at the first step.
        self._kernel = load_kernel(self.BUILDER, self.SYMBOL, type(self).__name__, allow_torch_fallback)

    @property
    def uses_native_kernel(self) -> bool:
        """False when the pure-torch fallback is in use."""
        return self._kernel is not None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        check_group(type(self).__name__, self.param_groups[-1])

    # ---- subclass interface ---------------------------------------------------------------------
    # Concrete optimizers define _hyper(group) -> list[float] (the kernel's hyper array) and
    # _torch_update(group, items) (the fallback); _per_tensor is needed only when the update depends on the step.
    def _per_tensor(self, group: dict[str, Any], step: int) -> tuple[float, float]:
        return (0.0, 0.0)

    # ---- step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             fp16_param_groups: Sequence[Sequence[torch.Tensor]] | None = None) -> Any:
        """One update of every param with a grad.

        ``fp16_param_groups[g][i]``, when given, receives the updated value of param i of group g in
        its own dtype (bf16/fp16/fp32, same numel): for fp32 params and contiguous CPU targets the
        kernel writes it in the same pass as the update (ZeRO-Offload's update-and-copy); other
        targets (e.g. CUDA tensors) get a ``copy_`` after the update.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if fp16_param_groups is not None and len(fp16_param_groups) != len(self.param_groups):
            raise ValueError(f"fp16_param_groups has {len(fp16_param_groups)} groups; the optimizer has "
                             f"{len(self.param_groups)}")
        for gi, group in enumerate(self.param_groups):
            check_group(type(self).__name__, group)
            targets = None if fp16_param_groups is None else fp16_param_groups[gi]
            items = self._gather(group, gi, targets)
            if not items:
                continue
            if self._kernel is None:
                self._torch_update(group, items)
                late = [(it[0], it[3]) for it in items if it[3] is not None]
            else:
                late = self._native_update(group, items)
            for param, target in late:
                target.copy_(param.view(target.shape), non_blocking=target.is_pinned() or target.is_cuda)
        return loss

    def _gather(self, group: dict[str, Any], gi: int, targets: Sequence[torch.Tensor] | None) -> list[Item]:
        name = type(self).__name__
        if targets is not None and len(targets) != len(group["params"]):
            raise ValueError(f"fp16_param_groups[{gi}] has {len(targets)} tensors; group {gi} has "
                             f"{len(group['params'])} params")
        items = []
        state_names = self.STATE_NAMES
        for pi, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            # cheap attribute checks first; the kernel trusts numel and contiguity (memory safety)
            if not (p.is_cpu and p.dtype in DTYPE_CODES and p.is_contiguous()):
                raise ValueError(f"{name}: param {pi} of group {gi} is {p.dtype} on {p.device} "
                                 f"(contiguous={p.is_contiguous()}); expected a contiguous CPU float32/bfloat16/"
                                 "float16 tensor")
            if not (grad.is_cpu and grad.layout is torch.strided and grad.numel() == p.numel()
                    and (grad.dtype is p.dtype or grad.dtype is torch.float32)):
                raise ValueError(f"{name}: grad of param {pi} of group {gi} is {grad.dtype} {tuple(grad.shape)} "
                                 f"on {grad.device} (sparse={grad.is_sparse}); expected a dense CPU tensor of "
                                 f"shape {tuple(p.shape)} and dtype {p.dtype} or float32")
            if not grad.is_contiguous():
                grad = grad.contiguous()
            state = self.state[p]
            if not state:
                self._init_state(p, state)
            state["step"] += 1
            target = None
            if targets is not None:
                target = targets[pi]
                if target.numel() != p.numel() or not target.is_floating_point():
                    raise ValueError(f"fp16_param_groups[{gi}][{pi}] is {target.dtype} with {target.numel()} "
                                     f"elements; expected a floating tensor with {p.numel()}")
            items.append((p, grad, [state[k] for k in state_names], target, state["step"]))
        return items

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
        for key in self.STATE_NAMES:
            state[key] = torch.zeros(p.shape, dtype=dtype)

    def _native_update(self, group: dict[str, Any], items: list[Item]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Bucket by dtypes, one kernel call per bucket; returns (param, target) pairs copied afterwards."""
        buckets: dict[tuple[int, ...], list[Item]] = defaultdict(list)
        late = []
        for it in items:
            p, grad, states, target, _ = it
            copy_code = NO_COPY
            if target is not None:
                if p.dtype == torch.float32 and target.device.type == "cpu" and target.is_contiguous() \
                        and target.dtype in DTYPE_CODES:
                    copy_code = DTYPE_CODES[target.dtype]
                else:
                    late.append((p, target))
            key = (DTYPE_CODES[p.dtype], DTYPE_CODES[grad.dtype], DTYPE_CODES[states[0].dtype], copy_code)
            buckets[key].append(it)
        hyper = self._hyper(group)
        nthreads = torch.get_num_threads()
        per_step: dict[int, tuple[float, float]] = {}
        for key, bucket in buckets.items():
            slots, numels, per = array("q"), array("q"), array("f")
            fused_copy = key[3] != NO_COPY
            for p, grad, states, target, step in bucket:
                slots.extend((p.data_ptr(), grad.data_ptr(), states[0].data_ptr(),
                              states[1].data_ptr() if len(states) > 1 else 0,
                              target.data_ptr() if fused_copy else 0))
                numels.append(p.numel())
                scalars = per_step.get(step)
                if scalars is None:
                    scalars = per_step[step] = self._per_tensor(group, step)
                per.extend(scalars)
            self._kernel(slots, numels, per, hyper, key, nthreads)
        return late

    # ---- state_dict -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout, with each ``step`` a float32 scalar tensor as ``torch.optim.Adam``/``Adagrad`` save
        it: the state then loads into torch's optimizers, whose fused and foreach kernels take tensor steps
        only (a resume that turns ``offload_optimizer`` off). In memory the step stays an int (the kernel's)."""
        sd = super().state_dict()
        sd["state"] = {k: {**v, "step": torch.tensor(float(v["step"]), dtype=torch.float32)}
                       if "step" in v and not torch.is_tensor(v["step"]) else v for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own or a torch optimizer's state_dict (matching names; ``step`` as int or tensor).

        Unlike torch's loader this keeps float32 states float32 for low-precision params (the state
        dtype follows ``fp32_optimizer_states``), and fills group keys missing in the saved groups
        from the current groups.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups; the optimizer has "
                             f"{len(self.param_groups)}")
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"state_dict param group {gi} has {len(saved['params'])} params; the optimizer's "
                                 f"has {len(group['params'])}")
        id_map = dict(zip(itertools.chain.from_iterable(g["params"] for g in saved_groups),
                          itertools.chain.from_iterable(g["params"] for g in self.param_groups), strict=True))
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for key, value in state_dict["state"].items():
            if key not in id_map:
                raise ValueError(f"state_dict['state'] has an entry for param id {key!r} that no group lists")
            state[id_map[key]] = self._import_state(id_map[key], value)
        groups = []
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            merged = {k: v for k, v in group.items() if k != "params"}
            merged.update({k: v for k, v in saved.items() if k != "params"})
            merged["params"] = group["params"]
            check_group(type(self).__name__, merged)
            groups.append(merged)
        self.__setstate__({"state": state, "param_groups": groups})

    def _import_state(self, p: torch.Tensor, saved: dict[str, Any]) -> dict[str, Any]:
        dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
        out: dict[str, Any] = {}
        for key, value in saved.items():
            key = self.STATE_ALIASES.get(key, key)
            if key == "step":
                out[key] = int(value.item()) if torch.is_tensor(value) else int(value)
            elif torch.is_tensor(value) and value.is_floating_point():
                if value.shape != p.shape:
                    raise ValueError(f"state {key!r} has shape {tuple(value.shape)}; its param has {tuple(p.shape)}")
                out[key] = value.to(device="cpu", dtype=dtype, copy=True).contiguous()
            else:
                out[key] = value
        missing = [k for k in ("step", *self.STATE_NAMES) if k not in out]
        if missing:
            raise ValueError(f"{type(self).__name__}: saved state lacks {missing}; it has {sorted(saved)}")
        return out

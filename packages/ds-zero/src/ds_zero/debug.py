"""Read and modify the partitioned model states of ZeRO stages 1 and 2 (``deepspeed.utils.safe_*``).

Each rank holds only its partition of the fp32 master weights, of the optimizer states and (after the
reduction) of the averaged gradients. The ``safe_get_full_*`` functions rebuild a parameter's full value:
every rank writes the fragments it owns into a zero tensor of the full size and one all-reduce (sum) over
the data-parallel group adds them up, which is exact because every element has exactly one owner. They are
collective: every rank must call them, in the same order. The ``safe_set_full_*`` functions are local: each
rank writes the fragments it owns from the full value, so every rank must pass the same value.

Gradient phases (as the spec says: after ``backward`` and before ``step``): once the reducer has averaged
this window's gradients into the partitions (stage 2 after every backward; stage 1 at the accumulation
boundary on more than one rank) the gradient is read from and written to the partitions; before that (stage 1
between boundaries, or on one rank) it is the rank's local full gradient. Under fp16 loss scaling the
gradient values carry the current loss scale, as in DeepSpeed (the step unscales them).

The ``safe_*_local_*`` functions address ZeRO-3 partitions; for any other parameter they raise, as DeepSpeed
does for parameters without a ``ds_id``. Under ZeRO-Infinity the sub-group holding a parameter may keep its fp32
master, optimizer states and gradient on NVMe: each call reads that sub-group in for its duration and, when it
modifies it, writes it back (and the 16-bit partition through to its swap file).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_zero._flat_group import FlatGroup
from ds_zero.partition import Fragment
from ds_zero.registry import owner_of, unpartitioned_master
from ds_zero.utils import is_zero_param

__all__ = [
    "NotZero3ParameterError",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


class NotZero3ParameterError(AssertionError, ValueError):
    """A ``safe_*_local_*`` call on a parameter that is not ZeRO-3 partitioned (an ``AssertionError`` as in
    DeepSpeed, and a ``ValueError`` since it is a bad argument)."""


# ---- where a parameter lives ------------------------------------------------------------------------------------
def _require_owner(param: torch.nn.Parameter, call: str) -> Any:
    opt = owner_of(param)
    if opt is None:
        raise ValueError(f"{call}: this parameter (shape {tuple(param.shape)}, requires_grad={param.requires_grad}) "
                         "is not partitioned by a ZeRO stage 1/2 optimizer (a frozen parameter, a parameter the "
                         "optimizer was not given, or an engine running ZeRO stage 0); there is no partitioned "
                         "state to modify")
    return opt


def _locate(opt: Any, param: torch.nn.Parameter) -> tuple[Any, int]:
    g, index = opt.home[param]
    return opt.groups[g], index


def _own_fragments(group: Any, index: int) -> list[Fragment]:
    """The pieces of parameter ``index`` (flat order) that this rank's partition holds (none, one or more)."""
    return [frag for rank, frag in group.layout.owners(index) if rank == group.rank]


def _ranks_of(opt: Any, group: Any) -> tuple[Any, int]:
    """``(process group, world size)`` a group's partitions span: a stage 1/2 group's own (a MoE expert group's
    expert-data-parallel group), else the optimizer's data-parallel group."""
    if isinstance(group, FlatGroup):
        return group.process_group, group.layout.world_size
    if group.params and group.layout.world != opt.world:  # ZeRO-3 AutoEP experts: their expert-data-parallel group
        return group.params[0].ds_space.group, group.layout.world
    return opt.dp_group, opt.world


def _result_device(opt: Any, param: torch.nn.Parameter) -> torch.device:
    """The parameter's device, or the accelerator when NCCL needs one and the parameter is offloaded to CPU."""
    if param.device.type == "cpu" and opt.world > 1 and dist.get_backend(opt.dp_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return param.device


def _numel(param: torch.nn.Parameter) -> int:
    """Elements of the whole parameter (a ZeRO-3 parameter's own tensor may be empty)."""
    return param.ds_numel if is_zero_param(param) else param.numel()


def _shape(param: torch.nn.Parameter) -> torch.Size:
    return param.ds_shape if is_zero_param(param) else param.shape


@contextlib.contextmanager
def _resident(opt: Any, params: Sequence[torch.nn.Parameter], write_back: bool, grads: bool = False) -> Iterator[None]:
    """ZeRO-Infinity: the NVMe sub-groups of ``params`` (masters and optimizer states, or with ``grads`` the
    gradient partitions) in memory for the duration, written back afterwards when ``write_back``."""
    find = getattr(opt, "swapped_sub_groups", None)
    ids = find(params) if find is not None else []
    if not ids:
        yield
        return
    with (opt.grads_materialized(ids, write_back) if grads else opt.materialized(write_back, ids)):
        yield


def _flat_value(param: torch.nn.Parameter, value: Any, call: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{call}: value must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() != _numel(param):
        raise ValueError(f"{call}: value has shape {tuple(value.shape)} ({value.numel()} elements); the parameter "
                         f"has shape {tuple(_shape(param))} ({_numel(param)} elements)")
    return value.detach().reshape(-1)


def _init_adam_state(opt: Any, group: Any) -> None:
    """Create a torch Adam/AdamW group's state now, exactly as its first step would (zeros, step 0), so the state
    can be set before that step (the spec: "at any point after initialization"); other optimizers are left
    alone (their lazy state is theirs to define)."""
    inner, master = opt.optimizer, group.master
    if opt.optimizer.state.get(master) or not isinstance(inner, torch.optim.Adam):  # AdamW subclasses Adam
        return
    pg = next(g for g in inner.param_groups if any(p is master for p in g["params"]))
    on_device = pg.get("capturable") or pg.get("fused")
    step = torch.zeros((), dtype=torch.float32, device=master.device if on_device else "cpu")
    state = {"step": step, "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format)}
    if pg.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    inner.state[master] = state


def _state_partition(opt: Any, group: Any, key: Any, call: str) -> torch.Tensor:
    """The optimizer state ``key`` of a group's master partition (a flat tensor of the partition's size)."""
    state = opt.optimizer.state.get(group.master, {})
    numel = group.master.numel()
    available = sorted(str(k) for k, v in state.items()
                       if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == numel)
    value = state.get(key)
    if not (isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel):
        have = ", ".join(repr(k) for k in available) if available else "none (the optimizer has not stepped yet)"
        raise ValueError(f"{call}: optimizer state {key!r} is not a per-element state of "
                         f"{type(opt.optimizer).__name__}; available keys: {have}")
    return value.view(-1)


# ---- assembling and scattering ---------------------------------------------------------------------------------
def _assemble(opt: Any, params: Sequence[torch.nn.Parameter], partition_of: Callable[[Any], torch.Tensor],
              dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Full values of ``params`` from every rank's partitions (``partition_of(group)``), one all-reduce per
    process group the parameters' groups are partitioned over (the data-parallel one; a MoE expert group's own).

    The sum runs in at least fp32 so that every backend reduces it; widening and narrowing back is exact."""
    device = _result_device(opt, params[0])
    work = torch.float32
    for dtype in dtypes:
        work = torch.promote_types(work, dtype)
    by_channel: dict[tuple[int, int], list[int]] = {}  # parameters laid out contiguously per process group
    for k, p in enumerate(params):
        group, _ = _locate(opt, p)
        process_group, world = _ranks_of(opt, group)
        by_channel.setdefault((id(process_group), world), []).append(k)
    offsets, spans, total = [0] * len(params), [], 0
    for members in by_channel.values():
        start = total
        for k in members:
            offsets[k] = total
            total += _numel(params[k])
        spans.append((*_ranks_of(opt, _locate(opt, params[members[0]])[0]), start, total - start))
    buf = torch.zeros(total, dtype=work, device=device)
    with torch.no_grad():
        for p, offset in zip(params, offsets, strict=True):
            group, index = _locate(opt, p)
            part = partition_of(group)
            for frag in _own_fragments(group, index):
                buf.narrow(0, offset + frag.tensor_offset, frag.numel).copy_(
                    part.narrow(0, frag.partition_offset, frag.numel))
        for process_group, world, start, numel in spans:
            if world > 1:
                opt.comm.all_reduce(buf.narrow(0, start, numel), group=process_group)
    return [buf.narrow(0, offset, _numel(p)).view(_shape(p)).to(dtype)
            for p, offset, dtype in zip(params, offsets, dtypes, strict=True)]


def _scatter(opt: Any, param: torch.nn.Parameter, partition_of: Callable[[Any], torch.Tensor],
             flat: torch.Tensor) -> None:
    """Write this rank's fragments of ``param`` in ``partition_of(group)`` from the full flat value."""
    group, index = _locate(opt, param)
    part = partition_of(group)
    with torch.no_grad():
        for frag in _own_fragments(group, index):
            part.narrow(0, frag.partition_offset, frag.numel).copy_(flat.narrow(0, frag.tensor_offset, frag.numel))


def _master(group: Any) -> torch.Tensor:
    return group.master.detach()


def _grad_partition(group: Any) -> torch.Tensor:
    return group.grad_partition


def _accum_dtype(opt: Any, param: torch.nn.Parameter) -> torch.dtype:
    """The gradient accumulation dtype, which the spec says the gradient getters return (stage 1 reduces into
    an fp32 partition whatever that dtype is: narrowing its values back is exact)."""
    return torch.float32 if opt.settings.fp32_grad_accum else param.dtype


def _whole_state(found: tuple[Any, torch.Tensor], key: Any, call: str) -> torch.Tensor:
    """Optimizer state ``key`` of a stage-0 fp32 master (not partitioned: the tensor itself)."""
    inner, master = found
    state = inner.state.get(master, {})
    value = state.get(key)
    if not (isinstance(value, torch.Tensor) and value.shape == master.shape):
        have = sorted(str(k) for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == master.shape)
        raise ValueError(f"{call}: optimizer state {key!r} is not a per-element state of {type(inner).__name__}; "
                         f"available keys: {', '.join(map(repr, have)) or 'none (the optimizer has not stepped yet)'}")
    return value


# ---- full fp32 parameters and optimizer states -------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full fp32 master value of ``param`` (its shape, on its device); None when no ZeRO optimizer
    partitions it. Collective."""
    opt = owner_of(param)
    if opt is None:  # stage 0 with fp16/bf16: the whole master, when there is one
        found = unpartitioned_master(param)
        return None if found is None else found[1].detach().clone()
    with _resident(opt, [param], write_back=False):
        return _assemble(opt, [param], _master, [torch.float32])[0]


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: Any) -> torch.Tensor | None:
    """The full fp32 optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``; None when no ZeRO
    optimizer partitions it. Collective; an unknown key raises ``ValueError`` listing the available keys."""
    opt = owner_of(param)
    if opt is None:
        found = unpartitioned_master(param)
        return None if found is None else _whole_state(found, optim_state_key,
                                                       "safe_get_full_optimizer_state").detach().clone()
    group, _ = _locate(opt, param)
    with _resident(opt, [param], write_back=False):
        state = _state_partition(opt, group, optim_state_key, "safe_get_full_optimizer_state")
        return _assemble(opt, [param], lambda g: state, [state.dtype])[0]


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 master value of ``param`` (this rank's fragments) and the model's (low-precision) weight.

    Every rank passes the same full ``value``, so each rank's copy of the weight equals what gathering the
    new master partitions would give (the same rounding), with no communication."""
    call = "safe_set_full_fp32_param"
    found = unpartitioned_master(param) if owner_of(param) is None else None
    if found is not None:
        with torch.no_grad():
            found[1].copy_(_flat_value(param, value, call).view(param.shape))
            param.data.copy_(found[1])
        return
    opt = _require_owner(param, call)
    flat = _flat_value(param, value, call)
    with torch.no_grad(), _resident(opt, [param], write_back=True):
        _scatter(opt, param, _master, flat)
        if is_zero_param(param):  # the 16-bit partition, and the whole value while it is gathered
            _lp_from_master(opt, param)
            if param.numel() == flat.numel():
                param.data.copy_(flat.view(param.shape))
        else:
            param.data.copy_(flat.view(param.shape))


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: Any) -> None:
    """Set the optimizer state ``optim_state_key`` of ``param`` (this rank's fragments) from the full value."""
    call = "safe_set_full_optimizer_state"
    found = unpartitioned_master(param) if owner_of(param) is None else None
    if found is not None:
        with torch.no_grad():
            _whole_state(found, optim_state_key, call).copy_(_flat_value(param, value, call).view(param.shape))
        return
    opt = _require_owner(param, call)
    flat = _flat_value(param, value, call)
    group, _ = _locate(opt, param)
    with _resident(opt, [param], write_back=True):
        _init_adam_state(opt, group)
        state = _state_partition(opt, group, optim_state_key, call)
        _scatter(opt, param, lambda g: state, flat)


# ---- gradients ---------------------------------------------------------------------------------------------------
def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient of ``param`` in the accumulation dtype (after backward, before step): the averaged one
    once reduced into the partitions (collective), else this rank's local one. None when there is none; a
    parameter no ZeRO optimizer partitions gives its ``.grad`` (as DeepSpeed does)."""
    opt = owner_of(param)
    if opt is None:
        return param.grad
    if opt.reducer.reduced:
        with _resident(opt, [param], write_back=False, grads=True):
            return _assemble(opt, [param], _grad_partition, [_accum_dtype(opt, param)])[0]
    grad = opt.get_grad(param)
    if grad is None:
        return None
    return grad.detach().to(_result_device(opt, param), copy=True).view(param.shape)


def _write_grad(opt: Any, param: torch.nn.Parameter, flat: torch.Tensor) -> None:
    if opt.reducer.reduced:
        with _resident(opt, [param], write_back=True, grads=True):
            _scatter(opt, param, _grad_partition, flat)
    else:  # the local gradient that the boundary reduction (or a one-rank step) will use: a copy, since the
        # next backward accumulates into it in place (the caller's tensor may also be given to other params)
        opt.set_grad(param, flat.to(param.device, copy=True).view(param.shape))


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the gradient of ``param`` (after backward, before step) with the full ``value``: this rank's
    fragments of the gradient partition once reduced, else the local gradient. Pass the accumulation dtype to
    avoid a rounding; every rank passes the same value."""
    call = "safe_set_full_grad"
    opt = owner_of(param)
    if opt is None and param.grad is not None:  # not partitioned: its own gradient (as DeepSpeed does)
        param.grad.copy_(_flat_value(param, value, call).view(param.shape))
        return
    opt = _require_owner(param, call)
    _write_grad(opt, param, _flat_value(param, value, call))


def _grad_updater(update_func: Callable) -> Callable[[torch.Tensor, torch.nn.Parameter], Any]:
    """``update_func(grad)``, or ``update_func(grad, param)`` when it takes two required arguments (the form
    DeepSpeed's own callers use)."""
    if not callable(update_func):
        raise TypeError(f"safe_update_full_grad_vectorized: update_func must be callable, got "
                        f"{type(update_func).__name__}")
    try:
        required = [p for p in inspect.signature(update_func).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):  # builtins without a signature take the gradient alone
        required = []
    if len(required) >= 2:
        return update_func
    return lambda grad, param: update_func(grad)


def safe_update_full_grad_vectorized(param_list: Sequence[torch.nn.Parameter], update_func: Callable) -> None:
    """Replace each parameter's full gradient ``g`` by ``update_func(g)``, assembling the reduced gradients of
    all the parameters an optimizer partitions in one collective (every rank calls with the same list)."""
    call = _grad_updater(update_func)
    owners: dict[int, tuple[Any, list[torch.nn.Parameter]]] = {}
    for p in param_list:
        opt = owner_of(p)
        if opt is None:
            if p.grad is not None:
                p.grad.copy_(_flat_value(p, call(p.grad, p), "update_func's result").view(p.shape))
            continue
        owners.setdefault(id(opt), (opt, []))[1].append(p)
    for opt, params in owners.values():
        if opt.reducer.reduced:
            dtypes = [_accum_dtype(opt, p) for p in params]
            with _resident(opt, params, write_back=False, grads=True):
                grads = _assemble(opt, params, _grad_partition, dtypes)
        else:
            grads = [safe_get_full_grad(p) for p in params]
        for p, grad in zip(params, grads, strict=True):
            if grad is not None:
                _write_grad(opt, p, _flat_value(p, call(grad, p), "update_func's result"))


# ---- ZeRO-3 local partitions --------------------------------------------------------------------------------------
def _zero3_only(call: str, param: torch.nn.Parameter) -> NotZero3ParameterError:
    opt = owner_of(param)
    if is_zero_param(param):
        what = "it has a ds_id, but no ZeRO stage 3 optimizer of this version partitions it"
    elif opt is not None:
        what = f"it is partitioned by ZeRO stage {opt.settings.stage}, whose parameters keep their full shape"
    else:
        what = "it is not partitioned by ZeRO"
    full = call.replace("_local_", "_full_")
    return NotZero3ParameterError(f"{call}: this API is only defined for ZeRO-3 partitioned parameters (with a "
                                  f"ds_id); {what}. Use {full} for the full value")


def _zero3_owner(param: torch.nn.Parameter, call: str) -> Any:
    opt = owner_of(param)
    if not is_zero_param(param) or opt is None or not hasattr(opt, "group_of"):
        raise _zero3_only(call, param)
    return opt


def _zero3_reader(param: torch.nn.Parameter, call: str) -> Any | None:
    """The owner for a ``safe_get_local_*`` read; None for a ZeRO-3 parameter no optimizer partitions (frozen, or
    not given to it), which has no fp32 value, gradient or state, as the ``safe_get_full_*`` reads answer."""
    if is_zero_param(param) and owner_of(param) is None:
        return None
    return _zero3_owner(param, call)


def _lp_from_master(opt: Any, param: torch.nn.Parameter) -> None:
    """This rank's 16-bit partition of ``param`` from its fp32 master slice (written through to its swap file
    when the partition lives on NVMe: the file is the value)."""
    value = opt.group_of(param).master_slice(param)
    swapper = getattr(param, "ds_swapper", None)
    if swapper is not None:
        swapper.write(param, value)
    else:
        param.ds_tensor.copy_(value)


def _local_value(param: torch.nn.Parameter, value: Any, call: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{call}: value must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() != param.ds_tensor.numel():
        raise ValueError(f"{call}: value has {value.numel()} elements; this rank's partition of the parameter (shape "
                         f"{tuple(param.ds_shape)}) has {param.ds_tensor.numel()} (param.ds_tensor.shape)")
    return value.detach().reshape(-1)


def _local_state(opt: Any, param: torch.nn.Parameter, key: Any, call: str) -> torch.Tensor:
    group = opt.group_of(param)
    state = _state_partition(opt, group, key, call)
    i = group.index[id(param)]
    return state.narrow(0, group.offsets[i], param.ds_tensor.numel())


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """ZeRO-3 only: this rank's fp32 partition of ``param`` (``ds_tensor``'s size)."""
    opt = _zero3_reader(param, "safe_get_local_fp32_param")
    if opt is None:
        return None
    with _resident(opt, [param], write_back=False):
        return opt.group_of(param).master_slice(param).clone()


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """ZeRO-3 only: this rank's gradient partition of ``param`` (after backward, before step), in the
    accumulation dtype."""
    opt = _zero3_reader(param, "safe_get_local_grad")
    if opt is None:
        return None
    with _resident(opt, [param], write_back=False, grads=True):
        return opt.group_of(param).grad_slice(param).clone()


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: Any) -> torch.Tensor | None:
    """ZeRO-3 only: this rank's partition of optimizer state ``optim_state_key`` of ``param``."""
    opt = _zero3_reader(param, "safe_get_local_optimizer_state")
    if opt is None:
        return None
    with _resident(opt, [param], write_back=False):
        return _local_state(opt, param, optim_state_key, "safe_get_local_optimizer_state").clone()


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """ZeRO-3 only: set this rank's fp32 partition of ``param`` (and its 16-bit partition; a whole value gathered
    at the moment follows at the next step)."""
    call = "safe_set_local_fp32_param"
    opt = _zero3_owner(param, call)
    with torch.no_grad(), _resident(opt, [param], write_back=True):
        opt.group_of(param).master_slice(param).copy_(_local_value(param, value, call))
        _lp_from_master(opt, param)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """ZeRO-3 only: set this rank's gradient partition of ``param``."""
    call = "safe_set_local_grad"
    opt = _zero3_owner(param, call)
    with torch.no_grad(), _resident(opt, [param], write_back=True, grads=True):
        opt.group_of(param).grad_slice(param).copy_(_local_value(param, value, call))


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: Any) -> None:
    """ZeRO-3 only: set this rank's partition of optimizer state ``optim_state_key`` of ``param``."""
    call = "safe_set_local_optimizer_state"
    opt = _zero3_owner(param, call)
    with torch.no_grad(), _resident(opt, [param], write_back=True):
        _init_adam_state(opt, opt.group_of(param))
        _local_state(opt, param, optim_state_key, call).copy_(_local_value(param, value, call))

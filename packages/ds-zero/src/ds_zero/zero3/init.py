"""``deepspeed.zero.Init``, ``GatheredParameters`` and external-parameter registration.

``Init`` partitions parameters as the model is built: when a submodule is attached to its parent its
constructor is finished, so its parameters (the same on every rank after a broadcast from rank 0) are
partitioned right there, through torch's global module-registration hook; whatever is left (the top-level
module's own parameters) is partitioned when the context exits. A model larger than one rank's memory can so
be built one submodule at a time. Inside the context the default device is the rank's accelerator (as
DeepSpeed's patched tensor constructors do), and, with ``override_module_apply``, ``Module.apply`` gathers each
module's parameters around the function (rank 0's result is kept). Both are restored on exit, also on an
exception and in nested contexts (only the outermost one installs and removes them).

Unlike DeepSpeed, the tensor constructors are not wrapped: modules initialise in the default dtype (so a model
built under ``Init`` starts from the same values as one built without it) and the partition dtype is applied
when the parameters are partitioned. DeepSpeed's wrapper (``zero_wrapper_for_fp_tensor_constructor``) and
``_orig_torch_arange`` still exist at ``deepspeed.runtime.zero.partition_parameters``, because clients read and
replace them around ``Init`` (Transformers' ``prevent_arange_dtype_change``, entered by every ZeRO-3
``from_pretrained``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules import module as torch_module

import ds_zero.zero3._guard as _guard
from ds_zero.zero3._collectives import broadcast_into_partitions
from ds_zero.zero3.convert import convert_param
from ds_zero.zero3.param import PartitionSpace, ZeroParamStatus, is_partitioned

_LOCAL = threading.local()

# DeepSpeed's names for the unwrapped constructors (Transformers compares the functions it is given against
# _orig_torch_arange; tests and clients read or replace the others around Init, which never wraps them here)
_orig_torch_tensor, _orig_torch_empty, _orig_torch_zeros = torch.tensor, torch.empty, torch.zeros
_orig_torch_ones, _orig_torch_full, _orig_torch_arange = torch.ones, torch.full, torch.arange
_orig_torch_eye, _orig_torch_randn = torch.eye, torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn: Any, target_fp_dtype: torch.dtype,
                                           target_device: torch.device | None = None) -> Any:
    """DeepSpeed's constructor wrapper: ``fn`` with ``device`` defaulting to ``target_device`` (the rank's
    accelerator, or the CPU) and floating results cast to ``target_fp_dtype``. ``Init`` does not install it
    (see the module's docstring); it is kept, with DeepSpeed's signature, for clients that wrap or call it."""
    device = target_device if target_device is not None else _compute_device()

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = device
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point() and tensor.dtype != target_fp_dtype:
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


def _ensure_process_group() -> None:
    """As DeepSpeed does: a launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR) starts the default group."""
    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ \
            and "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def _read_config(config_dict_or_path: Any, config: Any) -> dict[str, Any]:
    source = config_dict_or_path if config_dict_or_path is not None else config
    if source is None:
        return {}
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, encoding="utf-8") as handle:
                return json.load(handle)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"zero.Init: config_dict_or_path={str(source)!r} is not a readable JSON file: {exc}") \
                from exc
    if isinstance(source, dict):
        return source
    to_dict = getattr(source, "to_dict", None) or getattr(source, "config", None)
    if callable(to_dict):
        return to_dict()
    if isinstance(to_dict, dict):
        return to_dict
    raise TypeError(f"zero.Init: config_dict_or_path must be a dict, a JSON path or a DeepSpeedConfig, got "
                    f"{type(source).__name__}")


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled") in (True, "true", "auto")


def _config_dtype(cfg: dict[str, Any], dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    fp16, bf16 = _enabled(cfg.get("fp16")), _enabled(cfg.get("bf16")) or _enabled(cfg.get("bfloat16"))
    if fp16 and bf16:
        raise ValueError("zero.Init: the config enables both fp16 and bf16; enable one")
    if bf16:
        return torch.bfloat16
    if fp16:
        return torch.float16
    return torch.get_default_dtype()


def mpu_partition_group(mpu: Any) -> Any:
    """The group ZeRO-3 partitions over for a model-parallel unit: the sequence-data-parallel group when the mpu
    has a sequence axis (what ``deepspeed.initialize`` partitions over), else its data-parallel group."""
    sp = int(mpu.get_sequence_parallel_world_size()) if hasattr(mpu, "get_sequence_parallel_world_size") else 1
    return mpu.get_sequence_data_parallel_group() if sp > 1 else mpu.get_data_parallel_group()


def _remote_device(cfg: dict[str, Any], remote_device: Any) -> str:
    device = remote_device
    if device is None:
        offload = (cfg.get("zero_optimization") or {}).get("offload_param") or {}
        device = offload.get("device") if isinstance(offload, dict) else None
    device = str(getattr(device, "value", device) or "none").lower()
    if device not in ("none", "cpu", "cuda", "nvme"):
        raise ValueError(f"zero.Init: remote_device={remote_device!r} is not a known device; accepted: None, 'cpu', "
                         "'nvme'")
    return device


def _nvme_swapper(cfg: dict[str, Any]) -> Any:
    """``remote_device="nvme"``: a parameter swapper from the config's ``offload_param`` and ``aio`` sections."""
    from ds_zero.swap import ParamSwapper
    from ds_zero.swap.from_config import global_rank, param_swap_settings

    section = (cfg.get("zero_optimization") or {}).get("offload_param") or {}
    if not isinstance(section, dict) or not section.get("nvme_path"):
        raise ValueError("zero.Init: remote_device='nvme' needs zero_optimization.offload_param.nvme_path (a "
                         "directory on a local NVMe disk) in the config")
    return ParamSwapper(param_swap_settings({**section, "device": "nvme"}, cfg.get("aio")), global_rank())


def _contradicting_single_rank_pg_error(dp_world_size: int, explicit_process_group: Any,
                                       env: Any = None) -> str | None:
    """The message for a world of one rank where the launcher started several (``WORLD_SIZE`` > 1), else None.

    A size-1 process group set up before ``zero.Init`` (a library initialising torch.distributed by itself) would
    make every rank hold the whole model instead of its partition, which looks exactly like running out of memory.
    A group the caller passed explicitly is taken as meant (DeepSpeed's check, #8084)."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launched = int(env.get("WORLD_SIZE", "0") or "0")
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero.Init found a process group of world_size=1, but the launcher set WORLD_SIZE={launched}: a "
            "single-rank group was initialised before zero.Init (for example by from_pretrained before "
            "deepspeed.init_distributed()), so nothing would be partitioned and every rank would hold the whole model. "
            "Call deepspeed.init_distributed() before building the model under zero.Init, or pass "
            "data_parallel_group= if a single-rank group is what you want")


class Init:
    """Partition the parameters of every module built inside the context (or of ``module``, at once).

    ``data_parallel_group`` (or ``mpu_partition_group(mpu)``, or ``zero_param_parallel_group``): the ranks
    that share the partitions (default: the world). ``remote_device="cpu"`` keeps partitions in CPU memory,
    ``"nvme"`` in swap files under the config's ``offload_param.nvme_path`` (ZeRO-Infinity; or ``param_swapper``).
    ``dtype``: the partitions' dtype (default: fp16/bf16 from the config, else the default dtype).
    ``config_dict_or_path``/``config``: the DeepSpeed config (its ``zero_optimization`` and precision sections).
    ``enabled=False`` makes the context do nothing.
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        self.enabled = enabled
        if not enabled:
            return
        _ensure_process_group()
        cfg = _read_config(config_dict_or_path, config)
        zero = cfg.get("zero_optimization") or {}
        self.override_module_apply = bool(zero.get("override_module_apply", True))
        group = zero_param_parallel_group or data_parallel_group or sequence_data_parallel_group
        if group is None and mpu is not None:
            group = mpu_partition_group(mpu)
        self.dtype = _config_dtype(cfg, dtype)
        compute = _compute_device()
        where = _remote_device(cfg, remote_device)
        self.space = PartitionSpace.of(group, torch.device("cpu") if where in ("cpu", "nvme") else compute, compute)
        contradiction = _contradicting_single_rank_pg_error(self.space.world, group)
        if contradiction is not None:
            raise RuntimeError(contradiction)
        self.param_swapper = param_swapper if param_swapper is not None or where != "nvme" else _nvme_swapper(cfg)
        if zero_quantized_weights or zero_quantized_nontrainable_weights:  # ZeRO++ qwZ: int8 gathers
            from ds_zero.zeropp.options import ZeroPPOptions, zeropp_space

            self.space = zeropp_space(self.space, group, ZeroPPOptions(
                zero_quantized_weights=bool(zero_quantized_weights),
                zero_quantized_nontrainable_weights=bool(zero_quantized_nontrainable_weights)))
        self.pin_memory = pin_memory
        self.mem_efficient_linear = mem_efficient_linear
        self._created: list[Any] = []
        if module is not None:
            self._partition_module(module)

    # ---- partitioning ------------------------------------------------------------------------------------
    def _partition_params(self, params: Iterable[torch.nn.Parameter]) -> None:
        # a parameter on the meta device (torch.nn.utils.skip_init) has no values yet: it is partitioned once
        # ``to_empty`` gave it storage (see _install)
        todo = [p for p in dict.fromkeys(params) if not is_partitioned(p) and p.device.type != "meta"]
        if not todo:
            return
        space = self.space
        if space.world > 1:  # every rank starts from rank 0's initial values
            src = dist.get_global_rank(space.group, 0) if space.group is not None else 0
            with torch.no_grad():
                for p in todo:
                    space.comm.broadcast(p.data, src=src, group=space.group)
        for p in todo:
            if p.is_floating_point():
                convert_param(p, space, self.dtype)
            else:
                convert_param(p, space)
            if self.pin_memory and p.ds_tensor.device.type == "cpu" and torch.cuda.is_available():
                p.ds_tensor = p.ds_tensor.pin_memory()
        if self.param_swapper is not None:  # ZeRO-Infinity: the partitions go to NVMe as they are made
            from ds_zero.swap.from_config import swap_params

            swap_params(todo, None, self.param_swapper)

    def _partition_module(self, module: torch.nn.Module) -> None:
        # buffers keep their dtype (computed fp32 buffers such as RoPE's inv_freq); the engine casts the module
        self._partition_params(module.parameters())

    # ---- the context ---------------------------------------------------------------------------------------
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        stack = getattr(_LOCAL, "stack", None)
        if stack is None:
            stack = _LOCAL.stack = []
        stack.append(self)
        if len(stack) == 1:
            self._install()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        stack = _LOCAL.stack
        stack.remove(self)
        if not stack:
            self._uninstall()
        if exc[0] is None:
            self._partition_params(p for p in self._created if p is not None)
        self._created = []

    def _install(self) -> None:
        self._handles = [
            torch_module.register_module_module_registration_hook(self._on_submodule),
            torch_module.register_module_parameter_registration_hook(self._on_parameter),
        ]
        # only when it changes anything: set_default_device installs a global torch-function mode
        self._previous_device = None
        if self.space.compute_device.type != "cpu":
            self._previous_device = torch.get_default_device()
            torch.set_default_device(self.space.compute_device)
        self._original_apply = torch.nn.Module.apply
        if self.override_module_apply:
            torch.nn.Module.apply = _gathered_apply
        self._original_to_empty = torch.nn.Module.to_empty
        original_to_empty, init = self._original_to_empty, self

        def to_empty(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            out = original_to_empty(module, *args, **kwargs)
            init._current()._partition_module(out)  # skip_init's module: real storage now, uninitialized as asked
            return out
        torch.nn.Module.to_empty = to_empty
        _guard.construction_writer = _write_gathered

    def _uninstall(self) -> None:
        _guard.construction_writer = None
        for handle in self._handles:
            handle.remove()
        if self._previous_device is not None:
            torch.set_default_device(None if self._previous_device.type == "cpu" else self._previous_device)
        torch.nn.Module.apply = self._original_apply
        torch.nn.Module.to_empty = self._original_to_empty

    def _current(self) -> Init:
        return _LOCAL.stack[-1]

    def _on_submodule(self, parent: torch.nn.Module, name: str, child: Any) -> None:
        if isinstance(child, torch.nn.Module):
            self._current()._partition_module(child)

    def _on_parameter(self, module: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None:
            self._current()._created.append(param)


def _write_gathered(param: torch.nn.Parameter, op: Any) -> Any:
    """An in-place initialisation of a released parameter during construction: on the whole value (rank 0's is
    kept; every rank builds the same modules in the same order, so every rank gathers here), then partitioned."""
    with GatheredParameters([param], modifier_rank=0):
        return op()


def _gathered_apply(self: torch.nn.Module, fn: Any) -> torch.nn.Module:
    """``Module.apply`` with every module's partitioned parameters gathered around ``fn`` (rank 0's values kept)."""
    for child in self.children():
        child.apply(fn)
    params = [p for p in self.parameters(recurse=False) if is_partitioned(p)]
    with GatheredParameters(params, modifier_rank=0):
        fn(self)
    return self


# ---- gathering by hand ----------------------------------------------------------------------------------------
def _as_params(params: Any) -> list[torch.nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if isinstance(p, torch.Tensor)]


CONTEXT_DEPTH_ATTR = "_ds_z3_gathered_param_context_depth"  # GatheredParameters blocks holding the parameter
FALLBACK_OWNER_ATTR = "_ds_z3_eager_fallback_owner"  # DeepCompile's tracker of a parameter it gathered eagerly


class GatheredParameters:
    """Gather partitioned parameters for the block; with ``modifier_rank``, that rank's values become every
    rank's on exit (written into the partitions and, after ``deepspeed.initialize``, the fp32 masters).
    Collective: every rank of the parameters' group must enter with the same parameters."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None,
                 enabled: bool = True) -> None:
        self.params = [p for p in _as_params(params) if is_partitioned(p)] if enabled else []
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.gathered: list[torch.nn.Parameter] = []

    def __enter__(self) -> None:
        if not self.params:
            return
        overlapping = [p.ds_id for p in self.params if getattr(p, CONTEXT_DEPTH_ATTR, 0) > 0]
        if overlapping:  # DeepSpeed's rule: the outer block would see the inner one release its parameters
            raise RuntimeError("Nested GatheredParameters contexts cannot overlap parameters; parameter ds_ids "
                               f"already gathered by an outer context: {overlapping}")
        self.gathered = [p for p in self.params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        self.params[0].all_gather(param_list=self.params)
        self.fallback_owners = {}
        for p in self.params:
            setattr(p, CONTEXT_DEPTH_ATTR, getattr(p, CONTEXT_DEPTH_ATTR, 0) + 1)
            owner = getattr(p, FALLBACK_OWNER_ATTR, None)
            if owner is not None:  # gathered eagerly by a DeepCompile forward: the block adopts it
                self.fallback_owners[p.ds_id] = owner
                owner.record_user_context_claim(p)
        if self.fwd_module is not None:
            for p in self.params:
                register_external_parameter(self.fwd_module, p)

    def __exit__(self, *exc: Any) -> None:
        if not self.params:
            return
        try:
            if self.modifier_rank is not None and exc[0] is None:
                broadcast_into_partitions(self.params, self.modifier_rank)
                _refresh_masters(self.params)
        finally:
            self._release(updated=self.modifier_rank is not None and exc[0] is None)

    def _release(self, updated: bool) -> None:
        """What this block gathered goes back to the partitions (and what it adopted from a DeepCompile forward,
        unless that forward's backward still needs it: then it goes after that backward)."""
        owners = getattr(self, "fallback_owners", {})
        held = {p.ds_id for p in self.params if p.ds_id in owners and owners[p.ds_id].has_outstanding_graph_claim(p)}
        chosen = {id(p) for p in self.gathered} | {id(p) for p in self.params if p.ds_id in owners}
        to_release = [p for p in self.params if id(p) in chosen and p.ds_id not in held
                      and not getattr(p, "ds_active_sub_modules", None)]
        for p in self.params:
            if p.ds_id in held and updated:
                owners[p.ds_id].record_deferred_user_update(p)
            depth = getattr(p, CONTEXT_DEPTH_ATTR, 0)
            if depth <= 1:
                p.__dict__.pop(CONTEXT_DEPTH_ATTR, None)
            else:
                setattr(p, CONTEXT_DEPTH_ATTR, depth - 1)
        if to_release:
            to_release[0].partition(param_list=to_release, has_been_updated=False)
        for p in self.params:
            if p.ds_id in owners:
                owners[p.ds_id].release_user_context_claim(p)


def _refresh_masters(params: list[torch.nn.Parameter]) -> None:
    from ds_zero.registry import owner_of

    for p in params:
        owner = owner_of(p)
        refresh = getattr(owner, "refresh_master", None)
        if refresh is not None:
            refresh(p)


# ---- external parameters --------------------------------------------------------------------------------------
def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Gather ``parameter`` with ``module`` (forward and backward): it is used by ``module`` but owned elsewhere."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter: parameter must be a torch.nn.Parameter, got "
                        f"{type(parameter).__name__}")
    table = module.__dict__.setdefault("_external_params", {})
    table[id(parameter)] = parameter
    unit = getattr(module, "_z3_unit", None)
    if unit is not None:
        unit.add_external(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    table = module.__dict__.get("_external_params", {})
    if id(parameter) not in table:
        shape = tuple(getattr(parameter, "ds_shape", parameter.shape))
        raise ValueError(f"unregister_external_parameter: this parameter (shape {shape}) is not registered as "
                         f"external to {type(module).__name__}")
    del table[id(parameter)]
    unit = getattr(module, "_z3_unit", None)
    if unit is not None:
        unit.remove_external(parameter)

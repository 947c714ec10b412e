"""DeepSpeed's activation checkpointing API (``deepspeed.checkpointing``).

``checkpoint(function, *args)`` runs ``function`` without keeping its intermediate activations and recomputes them
in backward. It is built on ``torch.utils.checkpoint`` (non-reentrant, ``context_fn``): torch's saved-tensor hooks
drop what the region saves and recompute it on first use. What this module adds, as DeepSpeed does:

- the RNG state at forward (CPU generator, accelerator generator, and the ``CudaRNGStatesTracker`` states) is put
  back for the recompute, so dropout draws the same mask and recomputation is bitwise the forward;
- the region's *inputs*, the one thing it keeps, can be partitioned across the model-parallel (tensor) group
  (``partition_activations``: each rank keeps 1/n, all-gathered for the recompute), moved to host memory
  (``checkpoint_in_cpu``; unpartitioned inputs asynchronously, on a side copy stream, where the device has
  streams: ``offload_activations``) and copied into preallocated per-layer buffers (``contiguous_checkpointing``);
- an accelerator synchronize at the boundaries (``synchronize``) and forward/recompute timings (``profile``).

The inputs are held by the region (not captured by torch's closure), so the originals can be dropped after the
forward; autograd still routes their gradients through the forward graph. State is module-global, as DeepSpeed's
(``configure`` sets it; ``PARTITION_ACTIVATIONS``, ``CPU_CHECKPOINT``, ... are read by some clients).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing.config import activation_checkpointing_section
from deepspeed.runtime.activation_checkpointing.offload_activations import _ActivationOffloadEngine
from deepspeed.utils import logger
from deepspeed.utils.groups import (
    bwc_tensor_model_parallel_group,
    bwc_tensor_model_parallel_rank,
    bwc_tensor_model_parallel_world_size,
)
from deepspeed.utils.timer import FORWARD_GLOBAL_TIMER, SynchronizedWallClockTimer

__all__ = [
    "CudaRNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
    "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "non_reentrant_checkpoint", "reset",
]

deepspeed_checkpointing_enabled = False
mpu: Any = None
mp_rank, mp_size, mp_group = 0, 1, None
num_layers: int | None = None
PARTITION_ACTIVATIONS = False
CPU_CHECKPOINT = False
CONTIGUOUS_CHECKPOINTING = False
SYNCHRONIZE = False
PROFILE_TIME = False
timers: SynchronizedWallClockTimer | None = None

# contiguous_checkpointing: per activation-argument index, one preallocated buffer of ``num_layers`` slots
contiguous_data_buffers: list[torch.Tensor | None] = []
data_offsets: list[int] = []

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"

# cpu_checkpointing on a device with copy streams: inputs go to host memory asynchronously (offload_activations)
_offload_engine: _ActivationOffloadEngine | None = None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---- RNG ----------------------------------------------------------------------------------------------------
class CudaRNGStatesTracker:
    """Named accelerator RNG states (Megatron's tracker): ``add(name, seed)`` creates one, ``fork(name)`` runs a
    block on it and keeps its advance, leaving the default state untouched. On CPU the accelerator generator is
    the CPU generator."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A shallow copy of the states (the dict is new, the state tensors are shared)."""
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the states (not checked, as DeepSpeed)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; the current state is left as it was."""
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        accelerator = get_accelerator()
        orig = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states_[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on state ``name``, store its advanced state, then restore the original one."""
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        accelerator = get_accelerator()
        orig = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(orig)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide RNG states tracker."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` (same across a tensor-parallel group) and the tracker's
    ``model-parallel-rng`` state with ``seed + 2718 + tp_rank`` (different per tensor-parallel rank)."""
    tp_rank = bwc_tensor_model_parallel_rank(mpu)
    model_parallel_seed = seed + 2718 + tp_rank
    if _rank() == 0:
        dp_rank = mpu.get_data_parallel_rank() if hasattr(mpu, "get_data_parallel_rank") else 0
        logger.info(f"> initializing model parallel cuda seeds on global rank {_rank()}, model parallel rank "
                    f"{tp_rank}, and data parallel rank {dp_rank} with model parallel seed: {model_parallel_seed} "
                    f"and data parallel seed: {seed}")
    _CUDA_RNG_STATE_TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed the tracker's model-parallel state with ``seed + 2718 + tp_rank``."""
    with _CUDA_RNG_STATE_TRACKER.fork():
        get_accelerator().manual_seed(seed + 2718 + bwc_tensor_model_parallel_rank(mpu))


class _RngStates:
    """CPU, accelerator and tracker RNG states at one moment."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        on_host = get_accelerator().device_name() == "cpu"  # there the accelerator generator is the CPU one
        self.device = None if on_host else get_accelerator().get_rng_state()
        self.tracker = _CUDA_RNG_STATE_TRACKER.get_states()

    def restore(self) -> None:
        if self.device is not None:
            get_accelerator().set_rng_state(self.device)
        torch.set_rng_state(self.cpu)
        _CUDA_RNG_STATE_TRACKER.set_states(self.tracker)


# ---- what a region keeps of its inputs --------------------------------------------------------------------------
def is_activation_to_checkpoint(item: Any) -> bool:
    """A floating tensor with at least ``mp_size`` elements, not marked ``no_checkpointing``."""
    return (torch.is_tensor(item) and item.is_floating_point() and item.numel() >= mp_size
            and not getattr(item, "no_checkpointing", False))


def _contiguous_slot(index: int, partition: torch.Tensor) -> torch.Tensor:
    """Copy ``partition`` into the next slot of the buffer of activation argument ``index``."""
    while len(contiguous_data_buffers) <= index:
        contiguous_data_buffers.append(None)
        data_offsets.append(0)
    buffer = contiguous_data_buffers[index]
    numel = partition.numel()
    if buffer is None or buffer.dtype != partition.dtype or buffer.numel() != numel * num_layers:
        buffer = torch.empty(numel * num_layers, dtype=partition.dtype, device=partition.device)
        contiguous_data_buffers[index], data_offsets[index] = buffer, 0
    slot = data_offsets[index]
    if slot >= num_layers:
        raise RuntimeError(f"contiguous activation checkpointing: more than num_checkpoints={num_layers} "
                           "checkpoints stored before a backward (call deepspeed.checkpointing.reset() after an "
                           "eval forward)")
    data_offsets[index] = slot + 1
    return buffer.narrow(0, slot * numel, numel).copy_(partition)


def _async_offload_engine() -> _ActivationOffloadEngine | None:
    """The shared engine for whole (unpartitioned) host-checkpointed inputs on devices with copy streams; None
    where copies are blocking anyway (the CPU) or the input is a partition (copied into its own buffers)."""
    global _offload_engine
    if not CPU_CHECKPOINT or PARTITION_ACTIVATIONS or get_accelerator().is_synchronized_device():
        return None
    if _offload_engine is None:
        _offload_engine = _ActivationOffloadEngine(keep_last_count=1, min_offload_bytes=0)
    return _offload_engine


class _Kept:
    """One input activation as kept between forward and recompute: this rank's partition and/or a host copy
    (``token``: the copy is the async offload engine's)."""

    def __init__(self, tensor: torch.Tensor, index: int) -> None:
        self.shape, self.device, self.requires_grad = tensor.shape, tensor.device, tensor.requires_grad
        self.numel, self.partitioned = tensor.numel(), PARTITION_ACTIVATIONS and mp_size > 1
        self.token = None
        engine = _async_offload_engine()
        if engine is not None:
            self.token = engine.offload_input(tensor.detach())
            if self.token is not None:
                self.data = None
                return
        data = tensor.detach()
        if PARTITION_ACTIVATIONS:
            chunk = -(-self.numel // mp_size)
            flat = data.reshape(-1)
            if self.partitioned:
                flat = torch.nn.functional.pad(flat, (0, chunk * mp_size - self.numel))
            data = flat.narrow(0, chunk * mp_rank if self.partitioned else 0, chunk).clone()
        if CPU_CHECKPOINT:
            data = data.to("cpu")
        if CONTIGUOUS_CHECKPOINTING:
            data = _contiguous_slot(index, data)
        self.data = data

    def restore(self) -> torch.Tensor:
        if self.token is not None:  # consumed once; kept on the device for a second backward (retain_graph)
            self.data, self.token = _offload_engine.restore_input(self.token), None
        data = self.data.to(self.device)
        if self.partitioned:
            full = torch.empty(data.numel() * mp_size, dtype=data.dtype, device=data.device)
            dist.all_gather(list(full.chunk(mp_size)), data, group=mp_group)
            data = full.narrow(0, 0, self.numel)
        return data.view(self.shape).detach().requires_grad_(self.requires_grad)


class _RegionInputs:
    """A region's arguments: the originals during its forward, then only what ``keep`` decides to hold."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args: list[Any] = list(args)
        self.kept: list[Any] | None = None

    def keep(self) -> None:
        if not (PARTITION_ACTIVATIONS or CPU_CHECKPOINT):
            self.kept = self.args
            return
        kept, index = [], 0
        for arg in self.args:
            if is_activation_to_checkpoint(arg):
                arg, index = _Kept(arg, index), index + 1
            kept.append(arg)
        self.kept = kept

    def current(self) -> list[Any]:
        if self.kept is None:
            return self.args
        return [k.restore() if isinstance(k, _Kept) else k for k in self.kept]


# ---- the boundaries ---------------------------------------------------------------------------------------------
def _timers() -> SynchronizedWallClockTimer:
    global timers
    if timers is None:
        timers = SynchronizedWallClockTimer()
    return timers


@contextlib.contextmanager
def _boundary(timer: str) -> Iterator[None]:
    """Synchronize (``SYNCHRONIZE``) and time (``PROFILE_TIME``, logged as DeepSpeed's timers) a block."""
    if SYNCHRONIZE:
        get_accelerator().synchronize()
    if PROFILE_TIME:
        _timers()(timer).start()
    try:
        yield
    finally:
        if PROFILE_TIME:
            _timers()(timer).stop()
            _timers().log([timer])
        if SYNCHRONIZE:
            get_accelerator().synchronize()


@contextlib.contextmanager
def _recompute(forward_rng: _RngStates) -> Iterator[None]:
    """Around torch's recompute of a region: the forward's RNG states in, the current ones back after."""
    if CONTIGUOUS_CHECKPOINTING:  # backward started: the buffers now live only through the regions' kept slots
        contiguous_data_buffers.clear()
        data_offsets.clear()
    with _boundary("backward"):
        current = _RngStates()
        forward_rng.restore()
        try:
            yield
        finally:
            current.restore()


def _anchor(args: tuple[Any, ...]) -> torch.Tensor:
    """An empty tensor on the inputs' device: tells torch's checkpoint the device (autocast) without holding
    the inputs themselves."""
    device = next((a.device for a in args if torch.is_tensor(a)), torch.device(get_accelerator().device_name()))
    return torch.empty(0, device=device)


def _outputs(outputs: Any) -> Any:
    if torch.is_tensor(outputs) or not isinstance(outputs, (tuple, list)):
        return outputs
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _checkpointed(function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    with _boundary(FORWARD_GLOBAL_TIMER):
        if not torch.is_grad_enabled():  # no backward will come: nothing to keep or recompute
            return _outputs(function(*args))
        inputs, forward_rng = _RegionInputs(args), _RngStates()
        outputs = torch_checkpoint.checkpoint(
            lambda _anchor: function(*inputs.current()), _anchor(args), use_reentrant=False,
            preserve_rng_state=False, context_fn=lambda: (contextlib.nullcontext(), _recompute(forward_rng)))
        inputs.keep()
    return _outputs(outputs)


def checkpoint(function, *args):  # noqa: ANN001, ANN002, ANN201 -- DeepSpeed's signature
    """Run ``function(*args)`` keeping only its inputs (per ``configure``), recompute it in backward.

    Returns the function's outputs (a single output unwrapped, several as a tuple); non-tensor and non-grad
    arguments pass through unchanged. Gradients and outputs are bitwise those of ``function(*args)``.
    """
    return _checkpointed(function, args)


def non_reentrant_checkpoint(function, *args):  # noqa: ANN001, ANN002, ANN201 -- DeepSpeed's signature
    """DeepSpeed's non-reentrant variant; ``checkpoint`` is already non-reentrant, so this is the same."""
    return _checkpointed(function, args)


# ---- configuration -----------------------------------------------------------------------------------------------
def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    global PARTITION_ACTIVATIONS
    PARTITION_ACTIVATIONS = partition_activation
    if _rank() == 0:
        logger.info(f"**************Partition Activations {PARTITION_ACTIVATIONS}************")


def set_num_layers(nlayers: int) -> None:
    global num_layers
    num_layers = nlayers


def reset() -> None:
    """Drop the contiguous buffers and the host copies (call after forwards that had no backward, e.g. eval)."""
    contiguous_data_buffers.clear()
    data_offsets.clear()
    if _offload_engine is not None:
        _offload_engine.reset()


def _configure_defaults() -> None:
    global num_layers, PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, CPU_CHECKPOINT, SYNCHRONIZE, PROFILE_TIME
    PARTITION_ACTIVATIONS = CONTIGUOUS_CHECKPOINTING = CPU_CHECKPOINT = SYNCHRONIZE = PROFILE_TIME = False
    num_layers = None


def _configure_using_config(config: Any) -> None:
    global num_layers, PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, CPU_CHECKPOINT, SYNCHRONIZE, PROFILE_TIME
    section = activation_checkpointing_section(config, mpu=mpu)
    if _rank() == 0:
        logger.info(repr(section))
    PARTITION_ACTIVATIONS = section.partition_activations
    CONTIGUOUS_CHECKPOINTING = section.contiguous_memory_optimization
    num_layers = section.number_checkpoints
    CPU_CHECKPOINT = section.cpu_checkpointing
    SYNCHRONIZE = section.synchronize_checkpoint_boundary
    PROFILE_TIME = section.profile


class CheckpointingConfigError(ValueError, AssertionError):
    """A contradictory ``configure()`` call: a ``ValueError`` here, and an ``AssertionError`` for code written
    against DeepSpeed, which asserts these conditions."""


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,  # noqa: ANN001
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:  # noqa: ANN001
    """Configure activation checkpointing: defaults, then ``deepspeed_config``'s ``activation_checkpointing``
    section (a dict, JSON path, or config object), then every argument that is not None.

    ``mpu_``: an object with ``get_tensor_model_parallel_rank/world_size/group`` (or the ``get_model_parallel_*``
    ones): the group activations are partitioned over. ``contiguous_checkpointing`` needs
    ``partition_activations`` and ``num_checkpoints`` (``CheckpointingConfigError``, a ``ValueError`` and an
    ``AssertionError``, otherwise).
    """
    global mpu, num_layers, deepspeed_checkpointing_enabled, mp_rank, mp_size, mp_group
    global PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, CPU_CHECKPOINT, SYNCHRONIZE, PROFILE_TIME
    _configure_defaults()
    deepspeed_checkpointing_enabled = True
    if mpu_ is not None:
        mpu = mpu_
    if deepspeed_config is not None:
        _configure_using_config(deepspeed_config)
    PARTITION_ACTIVATIONS = PARTITION_ACTIVATIONS if partition_activations is None else partition_activations
    if contiguous_checkpointing is not None:
        CONTIGUOUS_CHECKPOINTING = contiguous_checkpointing
    num_layers = num_layers if num_checkpoints is None else num_checkpoints
    CPU_CHECKPOINT = CPU_CHECKPOINT if checkpoint_in_cpu is None else checkpoint_in_cpu
    SYNCHRONIZE = SYNCHRONIZE if synchronize is None else synchronize
    PROFILE_TIME = PROFILE_TIME if profile is None else profile
    if CONTIGUOUS_CHECKPOINTING and not PARTITION_ACTIVATIONS:
        raise CheckpointingConfigError("Contiguous Checkpointing is only available with partitioned activations. "
                                       "Set partitioned activations to true in deepspeed config")
    if CONTIGUOUS_CHECKPOINTING and num_layers is None:
        raise CheckpointingConfigError("Must specify the number of layers with contiguous memory checkpointing "
                                       "(num_checkpoints, or activation_checkpointing.number_checkpoints)")
    if mpu is not None:
        mp_rank = bwc_tensor_model_parallel_rank(mpu)
        mp_size = bwc_tensor_model_parallel_world_size(mpu)
        mp_group = bwc_tensor_model_parallel_group(mpu)
    reset()
    if _rank() == 0:
        logger.info("Activation Checkpointing Information")
        logger.info(f"----Partition Activations {PARTITION_ACTIVATIONS}, CPU CHECKPOINTING {CPU_CHECKPOINT}")
        logger.info(f"----contiguous Memory Checkpointing {CONTIGUOUS_CHECKPOINTING} with {num_layers} total layers")
        logger.info(f"----Synchronization {SYNCHRONIZE}")
        logger.info(f"----Profiling time in checkpointing {PROFILE_TIME}")


def is_configured() -> bool:
    """True once ``configure`` has been called."""
    return deepspeed_checkpointing_enabled

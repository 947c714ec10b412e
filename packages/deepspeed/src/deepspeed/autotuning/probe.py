"""The engine side of autotuning: inside each experiment's ranks, measure and write what the Autotuner reads.

With ``autotuning.enabled`` the engine attaches an :class:`AutotuningProbe` (forward hooks on its module, so
the engine itself changes by one line). Two modes, as DeepSpeed's engine has them:

* model-info profile (``autotuning.model_info.profile``): the first training forward counts the bytes of the
  tensors autograd saves for backward (the activation memory of one micro batch; parameters excluded), then
  rank 0 writes ``model_info_path`` (``num_params``, ``trainable_num_params``, ``activation_mem_per_gpu``,
  ``gpu_mem``) and every rank exits;
* metric (otherwise): steps ``start_profile_step`` .. ``end_profile_step`` (global, 1-based) are timed
  forward-to-forward; at the first forward after them the flops of one forward are counted
  (``FlopCounterMode``), rank 0 writes ``metric_path`` and every rank exits. The file holds ``latency`` (ms,
  the median step: a burst of other load on a shared host moves it less than the mean, ``latency_mean``),
  ``throughput`` (global samples/s), ``FLOPS_per_gpu`` (flop/s) and ``cpu_latency`` (rank 0's process CPU
  ms per step). The script must therefore train at least ``end_profile_step + 1`` steps.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.runtime.checkpointing.atomic import atomic_write_text

logger = logging.getLogger("deepspeed.autotuning")


def attach_probe(engine: Any, config: Any) -> AutotuningProbe | None:
    """An :class:`AutotuningProbe` on ``engine`` when ``config`` (the ``autotuning`` section) is enabled."""
    return AutotuningProbe(engine, config) if config.enabled else None


class AutotuningProbe:
    """Measures the experiment and ends the process (see the module docstring)."""

    def __init__(self, engine: Any, config: Any) -> None:
        self.engine = engine
        self.config = config
        self.profile_model_info = bool(config.model_info is not None and config.model_info.profile)
        self._marks: list[tuple[int, float]] = []  # (global steps done, time) at each step's first forward
        self._saved_bytes = 0
        self._saved_ptrs: set[tuple[int, int]] = set()
        self._ctx: Any = None
        self._flops: Any = None
        module = engine.module
        self._handles = [module.register_forward_pre_hook(self._pre_forward),
                         module.register_forward_hook(self._post_forward)]

    # ---- hooks ----------------------------------------------------------------------------------------
    def _training(self, module: torch.nn.Module) -> bool:
        return module.training and torch.is_grad_enabled()

    def _pre_forward(self, module: torch.nn.Module, _args: Any) -> None:
        if not self._training(module):
            return
        if self.profile_model_info:
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._ctx.__enter__()
            return
        done = self.engine.global_steps
        if self._flops is not None or done < self.config.start_profile_step - 1:
            return
        if not self._marks or (done != self._marks[-1][0] and self._marks[-1][0] < self.config.end_profile_step):
            if not self._marks:
                self._cpu0 = time.process_time()
            self._marks.append((done, self._now()))
        if done >= self.config.end_profile_step and len(self._marks) > 1:
            self._cpu = time.process_time() - self._cpu0
            self._flops = self._start_flops()

    def _post_forward(self, module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self.profile_model_info and self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
            self._write(self.config.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json"),
                        self._model_info())
            self._exit("model info")
        elif self._flops is not None:
            flops = self._stop_flops()
            self._write(self.config.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json"),
                        self._metrics(flops))
            self._exit("metrics")

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count a tensor saved for backward once per storage; parameters are model state, not activations."""
        if isinstance(tensor, torch.nn.Parameter) or isinstance(getattr(tensor, "_base", None),
                                                                 torch.nn.Parameter):
            return tensor
        try:
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse): count their data
            key = (id(tensor), tensor.numel() * tensor.element_size())
        if key not in self._saved_ptrs:
            self._saved_ptrs.add(key)
            self._saved_bytes += key[1]
        return tensor

    # ---- measurements ---------------------------------------------------------------------------------
    def _now(self) -> float:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()  # the time must cover the queued kernels
        return time.perf_counter()

    def _start_flops(self) -> Any:
        """Count this forward's flops with torch's ``FlopCounterMode`` (matmuls, convolutions, attention)."""
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        counter.__enter__()
        return counter

    def _stop_flops(self) -> int:
        self._flops.__exit__(None, None, None)
        return int(self._flops.get_total_flops())

    def _metrics(self, forward_flops: int) -> dict[str, Any]:
        engine = self.engine
        (first, t0), (last, t1) = self._marks[0], self._marks[-1]
        steps = last - first
        # per-step times: their median is the latency (a burst of other load on a shared host moves it less)
        per_step = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(self._marks, self._marks[1:], strict=False)]
        latency_s = statistics.median(per_step)
        gas = engine.gradient_accumulation_steps()
        step_flops = 3 * forward_flops * gas  # backward costs about twice the forward
        return {"latency": latency_s * 1e3, "throughput": engine.train_batch_size() / latency_s,
                "latency_mean": (t1 - t0) / steps * 1e3, "cpu_latency": self._cpu / steps * 1e3,
                "FLOPS_per_gpu": step_flops / latency_s, "steps": steps,
                "train_batch_size": engine.train_batch_size(),
                "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
                "gradient_accumulation_steps": gas, "world_size": engine.world_size}

    def _model_info(self) -> dict[str, Any]:
        engine = self.engine
        total = trainable = 0
        for p in engine.module.parameters():
            n = int(getattr(p, "ds_numel", p.numel()))  # a ZeRO-3 parameter's whole size
            total += n
            trainable += n if p.requires_grad else 0
        return {"num_params": total * engine.mp_world_size, "trainable_num_params": trainable * engine.mp_world_size,
                "activation_mem_per_gpu": self._saved_bytes, "gpu_mem": _memory_per_rank(engine.device),
                "rank": engine.global_rank}

    # ---- output ---------------------------------------------------------------------------------------
    def _write(self, path: str, data: dict) -> None:
        if self.engine.global_rank != 0:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=2))  # the Autotuner reads it once the ranks are gone
        logger.info("autotuning: wrote %s", os.path.abspath(path))

    def _exit(self, what: str) -> None:
        """End the experiment on every rank (the ranks reach this at the same forward)."""
        for handle in self._handles:
            handle.remove()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        if self.engine.global_rank == 0:
            print(f"Autotuning: done with running current ds config ({what} written).", flush=True)
        sys.exit(0)


def _memory_per_rank(device: torch.device) -> int:
    """Bytes one rank may use: the device's memory, or on CPU the host's memory shared by the local ranks."""
    from deepspeed.accelerator import get_accelerator

    total = int(get_accelerator().total_memory())
    if device.type == "cpu":
        total //= max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    return total

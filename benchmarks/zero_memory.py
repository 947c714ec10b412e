"""Per-rank memory of ZeRO stages 0, 1, 2, 2 + CPU optimizer offload and 3 against the theoretical figures.

Each configuration (stage x data-parallel world size N x precision) runs in a fresh launch of N gloo ranks:
build an MLP, ``deepspeed.initialize``, train two steps, and after the second backward (gradients live,
optimizer states allocated) account the bytes of the tensors the engine holds, per role, counting each
storage once (the model's parameters are views into ZeRO's flat buffer):

* ``params``: the model-dtype weights (ZeRO: the flat buffers, padding included);
* ``grads``: full local ``.grad`` tensors (stage 0 and 1); ``gpart``: ZeRO's gradient partitions (stage 2 keeps
  them for the run; stage 1 holds an fp32 one from the boundary reduction to the step, which the theory omits);
* ``master``: fp32 master weights (none for fp32 stage 0: the optimizer steps the model's own weights);
* ``optim``: the optimizer's state tensors (Adam: exp_avg, exp_avg_sq);
* ``buffers``: the reducer's communication buffers (stage 0: its 25 MB buckets; stages 1/2: one or two
  pooled buckets of at most ``reduce_bucket_size`` elements), reported beside the model states.
Stages 1/2 are counted by ``tests/ds-zero/_zero_memory_accounting.py`` (the tests' helper), stage 0 here.

Theory (bytes per parameter, Psi parameters, N ranks; ZeRO paper's 16 Psi accounting):
mixed precision (bf16 weights and gradients, fp32 master + Adam): stage 0 = 2 + 2 + 12, stage 1 =
2 + 2 + 12/N, stage 2 = 2 + 14/N; fp32: stage 0 = 4 + 4 + 8, stage 1 = 4 + 4 + 12/N, stage 2 = 4 + 16/N.
Offload is stage 2 with master + Adam states in host memory (the "host" column; on a CPU-only machine host
and device are the same memory). ``ratio`` = accounted model states (params + grads + master + optim) /
theory. Peak RSS is measured (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs`` once
the model is built): "peak growth" is the peak during initialize + 2 steps minus the RSS with the model built.
Stage 3 (``stage3``, config ``STAGE3``: every parameter partitioned, released right after use, no prefetch, 1e6
element reduce buckets): params = the weight partitions, gpart = the gradient partitions, theory 16 Psi / N
(fp32: 4 + 4 + 8, the fp32 partitions being the masters; bf16: 2 + 2 + 12 with the fp32 master); whole
values held (``live``) and reduce buckets are reported apart, and "pass max" is the largest of them (plus full
``.grad`` tensors) at any module's forward or gradient arrival. With stage 3 selected, a model of
``--layers`` x Linear(``--init_width``) is also built on 2 ranks with and without ``deepspeed.zero.Init``
(fresh ranks each): bytes its parameters hold after the build and peak RSS growth during it.
Run: ``python benchmarks/zero_memory.py`` (``--quick``: N = 1, 2 and a smaller model).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import os
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import free_port
from torch import nn

VARIANTS = ("stage0", "stage1", "stage2", "offload", "stage3")
# stage 3 with every parameter partitioned, released right after use and no gathers ahead, so that between two
# modules only partitions are held (the accounting then measures the partitions, not what the schedule keeps)
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
          "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": 1_000_000}
DTYPES = ("fp32", "bf16")
ROLES = ("params", "grads", "gpart", "master", "optim", "live", "buffers")
STATE_ROLES = ("params", "grads", "gpart", "master", "optim")
MB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_sizes", default="1,2,4", help="comma-separated data-parallel world sizes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {VARIANTS}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, from {DTYPES}")
    parser.add_argument("--width", type=int, default=1024, help="MLP width")
    parser.add_argument("--layers", type=int, default=8, help="MLP hidden layers (Linear(width, width) each)")
    parser.add_argument("--init_width", type=int, default=2048,
                        help="Linear width of the zero.Init build comparison (stage 3; 0: skip it)")
    parser.add_argument("--mmap_threshold", type=int, default=1 << 20,
                        help="MALLOC_MMAP_THRESHOLD_ (bytes) of the zero.Init build's ranks (0: glibc's default)")
    parser.add_argument("--quick", action="store_true", help="N = 1, 2; width 512")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.width, args.init_width = "1,2", 512, min(args.init_width, 1024)
    try:
        args.world_sizes = [int(n) for n in args.world_sizes.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--world_sizes must be comma-separated integers, got {args.world_sizes!r}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for name, chosen, known in (("variants", args.variants, VARIANTS), ("dtypes", args.dtypes, DTYPES)):
        bad = [c for c in chosen if c not in known]
        if bad or not chosen:
            parser.error(f"--{name}: unknown or empty {bad or chosen}; accepted: {', '.join(known)}")
    if not args.world_sizes or min(args.world_sizes) < 1 or min(args.width, args.layers) < 1:
        parser.error("--world_sizes entries, --width and --layers must be >= 1")
    return args


def theory_bytes(variant: str, dtype: str, psi: int, n: int) -> float:
    """Model-state bytes on one rank (the formulas in the module docstring; stages 1/2 from the tests' helper)."""
    lp = 2 if dtype == "bf16" else 4
    if variant == "stage0":
        return 16.0 * psi
    if variant == "stage3":  # all partitioned: fp32 4 + 4 + 8 (the fp32 partitions are the masters), bf16 2 + 2 + 12
        return 16.0 * psi / n
    return shared_accounting().theoretical_bytes(1 if variant == "stage1" else 2, psi, n, lp)


def ds_config(variant: str, dtype: str) -> dict:
    zero: dict = dict(STAGE3) if variant == "stage3" else {"stage": {"stage0": 0, "stage1": 1}.get(variant, 2)}
    if variant == "offload":
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


# ---- accounting ---------------------------------------------------------------------------------------------
def shared_accounting():
    """``tests/ds-zero/_zero_memory_accounting.py``: the stage 1/2 accounting and theory the tests assert with,
    loaded by path (test folders are not packages) so the benchmark and the tests count the same way."""
    name = "ds_zero_tests_memory_accounting"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "tests" / "ds-zero" / "_zero_memory_accounting.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


def _bytes_once(tensors, seen: set[tuple[str, int]]) -> int:
    total = 0
    for t in tensors:
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def account_stage0(engine) -> dict[str, int]:
    """Stage 0: the model's weights and ``.grad``; fp32 masters (mixed precision) in the optimizer; its buckets."""
    wrapper = engine.optimizer
    basic = wrapper.optimizer
    module_params = list(engine.module.parameters())
    ids = {id(p) for p in module_params}
    masters = [p for g in basic.param_groups for p in g["params"] if id(p) not in ids]
    seen: set[tuple[str, int]] = set()
    return {"master": _bytes_once(masters, seen),
            "optim": _bytes_once([t for st in basic.state.values() for t in st.values()
                                  if isinstance(t, torch.Tensor)], seen),
            "gpart": 0,
            "params": _bytes_once(module_params, seen),
            "grads": _bytes_once([p.grad for p in module_params + masters if p.grad is not None], seen),
            "live": 0, "buffers": _bytes_once([b.flat for b in getattr(engine.reducer, "buckets", [])], seen)}


def account_stage3(engine) -> dict[str, int]:
    """Stage 3: the flat partitions of the weights (``lp_flat``; every ``ds_tensor`` is a view into it), whole
    values held now (``live``: gathered or persistent parameters), the gradient partitions, the fp32 masters,
    Adam's states, and the reduce-scatter buckets allocated now."""
    wrapper = engine.optimizer
    seen: set[tuple[str, int]] = set()
    groups = wrapper.groups
    return {"params": _bytes_once([g.lp_flat for g in groups], seen),
            "live": _bytes_once([p.data for p in engine.module.parameters() if p.data.numel()], seen),
            "grads": _bytes_once([p.grad for p in engine.module.parameters() if p.grad is not None], seen),
            "gpart": _bytes_once([g.grad for g in groups], seen),
            "master": _bytes_once([g.master for g in groups], seen),
            "optim": _bytes_once([t for st in wrapper.optimizer.state.values() for t in st.values()
                                  if isinstance(t, torch.Tensor)], seen),
            "buffers": _bytes_once(engine.reducer.buffers(), seen)}


def account(engine) -> dict[str, int]:
    """Bytes per role held by this rank now, each storage counted once."""
    if engine.zero_optimization_stage() == 3:
        return account_stage3(engine)
    if not hasattr(engine.optimizer, "groups"):
        return account_stage0(engine)
    m = shared_accounting().account(engine.optimizer)
    return {"master": m.master, "optim": m.optimizer_state, "gpart": m.grad_partitions, "params": m.lp_params,
            "grads": m.full_grads, "live": 0, "buffers": m.buckets}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


# ---- the ranks ----------------------------------------------------------------------------------------------
def _mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class _PassSampler:
    """Stage 3: the largest accounted transient (whole parameter values held, full ``.grad`` tensors, reducer
    buckets) seen at every module's forward (after its gather) and at every gradient the reducer receives."""

    def __init__(self, engine) -> None:
        self.engine, self.max_bytes, self.on = engine, 0, False
        self.handles = [m.register_forward_pre_hook(lambda *_: self.sample()) for m in engine.module.modules()]
        reducer, inner = engine.reducer, engine.reducer.grad_ready

        def grad_ready(param):
            self.sample()
            return inner(param)
        reducer.grad_ready = grad_ready  # the engine looks it up on the instance

    def sample(self) -> None:
        if self.on:
            held = account_stage3(self.engine)
            self.max_bytes = max(self.max_bytes, held["live"] + held["grads"] + held["buffers"])


def _rank_main(rank: int, world: int, variant: str, dtype: str, args: argparse.Namespace, port: int,
               queue) -> None:
    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # a throwaway engine first: lazy imports and loaded kernels (code, not tensors) stay out of the peak
    warm, *_ = deepspeed.initialize(model=_mlp(8, 1), config=ds_config(variant, dtype))
    warm.destroy()
    del warm
    gc.collect()
    model = _mlp(args.width, args.layers)
    psi = sum(p.numel() for p in model.parameters())
    reset = _reset_peak_rss()
    rss_before = _status_kb("VmRSS")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(variant, dtype))
    sampler = _PassSampler(engine) if variant == "stage3" else None
    x = torch.randn(4, args.width).to(engine.module[0].weight.dtype)
    for step in range(2):
        if sampler is not None:
            sampler.on = step == 1
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        if step == 1:  # after one full step and the next backward: every role is live
            held = account(engine)
        engine.step()
    peak = _status_kb("VmHWM")
    engine.destroy()
    del engine
    gc.collect()
    row = {"rank": rank, "held": held, "rss_before_kb": rss_before, "peak_kb": peak, "peak_reset": reset,
           "params": psi, "pass_max": sampler.max_bytes if sampler is not None else None}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()  # joins the gloo threads (see _common on why nothing else holds the group)


class _LayerStack(nn.Module):
    """``layers`` x Linear(width) attached one at a time (as a transformer's blocks are), so that ``zero.Init``
    partitions each layer as soon as it exists."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(nn.Linear(width, width))


def _init_rank_main(rank: int, world: int, use_init: bool, args: argparse.Namespace, port: int, queue) -> None:
    """Build ``_LayerStack`` with or without ``zero.Init``: peak RSS growth of the build and the bytes the
    model's parameters hold after it (partitions under Init, whole values without)."""
    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": dict(STAGE3)}
    with deepspeed.zero.Init(config_dict_or_path=config):  # warm-up: imports and hooks out of the peak
        _LayerStack(8, 1)
    gc.collect()
    torch.manual_seed(0)
    reset = _reset_peak_rss()
    rss_before = _status_kb("VmRSS")
    if use_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = _LayerStack(args.init_width, args.layers)
    else:
        model = _LayerStack(args.init_width, args.layers)
    peak = _status_kb("VmHWM")
    seen: set[tuple[str, int]] = set()
    tensors = [getattr(p, "ds_tensor", p.data) for p in model.parameters()]
    row = {"held": _bytes_once(tensors, seen), "whole": _bytes_once([p.data for p in model.parameters()], set()),
           "psi": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
           "growth_kb": peak - rss_before, "peak_kb": peak, "peak_reset": reset}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, variant: str, dtype: str, args: argparse.Namespace) -> list[dict]:
    """One fresh launch; every rank's accounting and RSS figures."""
    return _launch(_rank_main, world, (world, variant, dtype, args))


def measure_init(world: int, use_init: bool, args: argparse.Namespace) -> list[dict]:
    """One fresh launch building the model with or without ``zero.Init``. With ``--mmap_threshold`` glibc's
    malloc gets a fixed mmap threshold (the ranks inherit the variable): blocks above it are mapped and unmapped
    on free, so peak RSS follows the bytes allocated. With glibc's default (a threshold that rises to the
    largest block freed, up to 32 MiB) a freed whole layer stays in the heap and the RSS measures the
    allocator's retention, not what the model holds."""
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if args.mmap_threshold > 0:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    try:
        return _launch(_init_rank_main, world, (world, use_init, args))
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def _launch(fn, world: int, args: tuple) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(fn, args=(*args, free_port(), queue), nprocs=world, join=True, start_method="spawn")
    return queue.get()


# ---- the report ---------------------------------------------------------------------------------------------
def format_row(variant: str, dtype: str, world: int, rows: list[dict]) -> str:
    """Rank 0's accounting (the largest rank's, to cover uneven padding) against the theory, max peak RSS."""
    top = max(rows, key=lambda r: sum(r["held"].values()))
    held, psi = top["held"], top["params"]
    states = sum(held[r] for r in STATE_ROLES)
    theory = theory_bytes(variant, dtype, psi, world)
    host = held["master"] + held["optim"] if variant == "offload" else 0
    growth = max(r["peak_kb"] - r["rss_before_kb"] for r in rows) * 1024
    peak = max(r["peak_kb"] for r in rows) * 1024
    cells = "".join(f" {held[r] / MB:>8.1f}" for r in ROLES)
    pass_max = max((r["pass_max"] for r in rows if r.get("pass_max") is not None), default=None)
    pass_cell = f"{pass_max / MB:>8.1f}" if pass_max is not None else f"{'-':>8}"
    line = (f"{variant:<8} {dtype:<5} {world:>2}{cells} {states / MB:>8.1f} {theory / MB:>8.1f} "
            f"{states / theory:>6.3f} {host / MB:>7.1f} {growth / MB:>8.1f} {peak / MB:>8.1f} {pass_cell}")
    return line


def format_init(world: int, rows_plain: list[dict], rows_init: list[dict], args: argparse.Namespace) -> list[str]:
    psi = rows_plain[0]["psi"]
    malloc = (f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold > 0
              else "glibc's default malloc")
    lines = [f"building {args.layers} x Linear({args.init_width}) ({psi / 1e6:.2f} M parameters, "
             f"{4 * psi / MB:.1f} MiB fp32) on {world} ranks, attached one layer at a time, {malloc} (MiB per rank, "
             "max over ranks):",
             f"{'build':<16} {'held':>8} {'whole':>8} {'peak+':>8} {'peak RSS':>8} {'peak+/full':>10}"]
    for name, rows in (("plain", rows_plain), ("zero.Init", rows_init)):
        held = max(r["held"] for r in rows)
        whole = max(r["whole"] for r in rows)
        growth = max(r["growth_kb"] for r in rows) * 1024
        peak = max(r["peak_kb"] for r in rows) * 1024
        lines.append(f"{name:<16} {held / MB:>8.1f} {whole / MB:>8.1f} {growth / MB:>8.1f} {peak / MB:>8.1f} "
                     f"{growth / (4 * psi):>10.3f}")
    return lines


def header(args: argparse.Namespace, psi: int | None) -> list[str]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    psi_text = f"{psi / 1e6:.2f} M parameters" if psi else "parameters counted per run"
    return [f"ZeRO per-rank memory: MLP {args.layers} x Linear({args.width}) ({psi_text}), AdamW, gloo ranks, CPU",
            f"machine: {os.cpu_count()} cores, torch {torch.__version__}, python {platform.python_version()}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, load (1 min) {load:.2f}", "",
            f"{'variant':<8} {'dtype':<5} {'N':>2}" + "".join(f" {r:>8}" for r in ROLES)
            + f" {'states':>8} {'theory':>8} {'ratio':>6} {'host':>7} {'peak+':>8} {'peak RSS':>8} {'pass max':>8}"]


FOOTER = ["", "MiB per rank (largest rank). states = params + grads + gpart + master + optim (accounted); theory: the",
          "16 Psi/N formulas (module docstring); ratio = states / theory (stage 1 > 1: its transient fp32 gradient",
          "partition, gpart). buffers: reducer buffers, not in states. host: master + Adam states that offload keeps",
          "in host memory. peak+: measured peak RSS growth during initialize + 2 steps over the RSS with the model",
          "built (max over ranks); peak RSS: absolute (max over ranks).",
          "stage 3: params = the weight partitions (lp_flat), gpart = gradient partitions; live = whole values held",
          "at the accounting point (persistent or still gathered; none with the config below) and buffers = the",
          "reduce-scatter buckets allocated then, both outside states; pass max = the largest live + full .grad +",
          "buckets accounted at any module's forward or gradient arrival of the second step (tensor accounting).",
          f"stage 3 config: {STAGE3}. theory 16 Psi/N: fp32 4 + 4 + 8 (weights, gradients, Adam; the fp32",
          "partitions are the masters), bf16 2 + 2 + 12 (with the fp32 master)."]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    psi = sum(p.numel() for p in _mlp(args.width, args.layers).parameters())
    lines = header(args, psi)
    print("\n".join(lines), flush=True)
    for dtype in args.dtypes:
        for variant in args.variants:
            for world in args.world_sizes:
                rows = measure(world, variant, dtype, args)
                if not all(r["peak_reset"] for r in rows):
                    print("(peak RSS could not be reset: peak+ includes start-up)", file=sys.stderr)
                print(format_row(variant, dtype, world, rows), flush=True)
    print("\n".join(FOOTER))
    if "stage3" in args.variants and args.init_width > 0:
        world = max(2, min(args.world_sizes))
        plain, init = measure_init(world, False, args), measure_init(world, True, args)
        print("\n".join(["", *format_init(world, plain, init, args),
                         "held: bytes the parameters hold after the build (partitions under Init; tensor accounting); "
                         "whole: their param.data; peak+: peak RSS growth during the build (VmHWM reset before it); "
                         "peak+/full: over the whole fp32 model's bytes."]))


if __name__ == "__main__":
    main()

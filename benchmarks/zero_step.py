"""Training step time of ZeRO stages 0, 1, 2 and 2 + CPU optimizer offload against plain torch DDP.

Every variant trains the same model from the same weights on the same batches, in the same ranks (gloo, CPU
by default), one after the other: each repetition times ``--steps`` optimizer steps of every variant, in a
rotating order so no variant always runs first. Models: a small MLP and a tiny GPT-2 (transformers'
``GPT2LMHeadModel`` with a small config). Variants:

* ``ddp``: ``DistributedDataParallel`` + ``torch.optim.AdamW(fused=True)`` (the baseline for stage 0);
* ``stage0`` / ``stage1`` / ``stage2``: ``deepspeed.initialize`` with ``zero_optimization.stage`` 0/1/2, the
  optimizer from the config (``AdamW``: ds-ops ``FusedAdam``), every other ZeRO option at its default;
* ``stage2+overlap``: stage 2 with ``overlap_comm`` and ``reduce_bucket_size`` ``--bucket`` elements;
* ``stage2+bcast`` (not in the default list): stage 2 with ``allgather_partitions: false`` (the updated
  partitions travel by one broadcast per owner instead of the point-to-point gather);
* ``offload``: stage 2 with ``offload_optimizer.device = cpu`` (the optimizer is ``DeepSpeedCPUAdam``);
* ``stage3``: ZeRO stage 3, every option at its default (``stage3_param_persistence_threshold`` 1e5 elements:
  parameters at or under it stay gathered for the run, the rest are gathered by each module's hooks before it
  runs and released after; with the default ``stage3_max_reuse_distance`` (1e9) and ``prefetch_bucket_size``);
* ``stage3_partitioned``: stage 3 with ``stage3_param_persistence_threshold: 0``: every parameter is gathered
  per module, released, and its gradient reduce-scattered into the partitions;
* ``stage3+offload``: stage 3 with ``offload_optimizer`` and ``offload_param`` on the CPU.

Reported per model: median step time (ms) and global samples/s, the ratio of every ZeRO stage's step time to
stage 0's and stage 0's throughput to DDP's (ratios of medians and medians of per-repetition ratios, which
cancel load that drifts over the run). After the timed repetitions a profiled pass (``--profile_steps``)
wraps the phases with ``perf_counter`` (forward; backward, of which the reducer's per-gradient hooks and its
final ``finish``; step, of which the basic optimizer's ``step`` kernel, the global-norm all-reduce and the
gather of updated partitions; stage 3: the scheduler's fetches (gathers included) and releases, of which the
gathers themselves, and the step's re-gather of persistent parameters) and prints their ms per step, which
gives the CPU Adam kernel's share of the offload step; ``--collectives`` adds gloo's ways of reducing and
gathering a buffer of the MLP's size.
Targets (issue 7): stages 1 and 2 <= 1.2x stage 0's step time; stage 0 >= 0.95x DDP; stage 3 <= 1.6x stage 0
(DeepSpeed 0.19.8 on the development machine: 2.6x GPT-2, 4.0x MLP).
Run: ``python benchmarks/zero_step.py`` (``--quick`` for a short run, ``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from _common import cpu_model, paired, spawn_ranks
from torch import nn

OPTIM = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
# variant -> its zero_optimization section ("ddp" is the torch baseline); every other option at its default
ZERO = {"stage0": {"stage": 0}, "stage1": {"stage": 1}, "stage2": {"stage": 2},
        "stage2+overlap": {"stage": 2, "overlap_comm": True},
        "stage2+bcast": {"stage": 2, "allgather_partitions": False},
        "offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "stage3": {"stage": 3},
        "stage3_partitioned": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "stage3+offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
VARIANTS = ("ddp", *ZERO)
DEFAULT_VARIANTS = ("ddp", "stage0", "stage1", "stage2", "stage2+overlap", "offload", "stage3", "stage3_partitioned",
                    "stage3+offload")
MODELS = ("mlp", "gpt2")
GPT2_VOCAB = 8192


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_size", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {MODELS}")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, from {VARIANTS}")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per variant (interleaved)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per repetition")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant before the first rep")
    parser.add_argument("--profile_steps", type=int, default=10, help="steps of the profiled pass (0: none)")
    parser.add_argument("--micro_batch", type=int, default=32, help="MLP samples per rank per step")
    parser.add_argument("--gpt_batch", type=int, default=8, help="GPT-2 sequences per rank per step")
    parser.add_argument("--mlp_width", type=int, default=1024, help="MLP hidden width")
    parser.add_argument("--mlp_layers", type=int, default=4, help="MLP hidden layers")
    parser.add_argument("--gpt_layers", type=int, default=4)
    parser.add_argument("--gpt_width", type=int, default=128, help="GPT-2 n_embd")
    parser.add_argument("--seq", type=int, default=64, help="GPT-2 tokens per sample")
    parser.add_argument("--bucket", type=int, default=500_000, help="reduce_bucket_size of stage2+overlap")
    parser.add_argument("--collectives", action="store_true",
                        help="also time gloo's collectives on a buffer of the first model's size")
    parser.add_argument("--quick", action="store_true", help="a short run: 3 reps x 2 steps, 1 warm-up step")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.warmup, args.profile_steps = 3, 2, 1, 3
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name, chosen, known in (("models", args.models, MODELS), ("variants", args.variants, VARIANTS)):
        bad = [c for c in chosen if c not in known]
        if bad or not chosen:
            parser.error(f"--{name}: unknown or empty {bad or chosen}; accepted: {', '.join(known)}")
    for name in ("world_size", "reps", "steps", "micro_batch", "gpt_batch", "mlp_width", "mlp_layers", "gpt_layers",
                 "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


# ---- models and batches -------------------------------------------------------------------------------------
class MLP(nn.Module):
    """``layers`` hidden Linear+GELU layers of ``width``; forward(batch) -> mean-squared error to a target."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*mods, nn.Linear(width, width))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)


class GPT2Loss(nn.Module):
    """transformers' GPT2LMHeadModel; forward(token ids (B, T)) -> the next-token cross-entropy (nats)."""

    def __init__(self, layers: int, width: int, seq: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=GPT2_VOCAB, n_positions=seq, n_embd=width, n_layer=layers, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.lm = GPT2LMHeadModel(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def build_model(name: str, args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)  # every variant and rank starts from the same weights
    if name == "mlp":
        return MLP(args.mlp_width, args.mlp_layers)
    return GPT2Loss(args.gpt_layers, args.gpt_width, args.seq)


def make_batches(name: str, args: argparse.Namespace, rank: int, count: int = 4) -> list:
    gen = torch.Generator().manual_seed(1234 + rank)
    if name == "mlp":
        return [(torch.randn(args.micro_batch, args.mlp_width, generator=gen),
                 torch.randn(args.micro_batch, args.mlp_width, generator=gen)) for _ in range(count)]
    return [torch.randint(0, GPT2_VOCAB, (args.gpt_batch, args.seq), generator=gen) for _ in range(count)]


def micro_batch(model: str, args: argparse.Namespace) -> int:
    return args.micro_batch if model == "mlp" else args.gpt_batch


# ---- variants -----------------------------------------------------------------------------------------------
def ds_config(variant: str, model: str, args: argparse.Namespace) -> dict:
    zero = dict(ZERO[variant])
    if zero.get("overlap_comm"):
        zero["reduce_bucket_size"] = args.bucket
    return {"train_micro_batch_size_per_gpu": micro_batch(model, args), "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {**OPTIM, "betas": list(OPTIM["betas"])}}}


Phases = dict[str, float]


def _timed(fn: Callable, acc: Phases, key: str) -> Callable:
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - start
    return wrapper


class DDPStep:
    """The baseline: a DDP forward/backward and a torch AdamW step per call."""

    def __init__(self, model: nn.Module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.model = DistributedDataParallel(model)
        # fused=True: torch's fastest AdamW on the CPU (what ds-ops' FusedAdam is measured against)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **OPTIM, fused=True)
        self.acc: Phases | None = None
        self.kernel = "AdamW(fused)"

    def profile(self) -> Phases:
        self.acc = defaultdict(float)
        return self.acc

    def __call__(self, batch) -> None:
        acc, t0 = self.acc, time.perf_counter()
        loss = self.model(batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if acc is not None:
            t3 = time.perf_counter()
            acc["forward"] += t1 - t0
            acc["backward"] += t2 - t1
            acc["step"] += t3 - t2
            acc["step.optimizer"] += t3 - t2


class EngineStep:
    """``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` for one ZeRO configuration."""

    def __init__(self, model: nn.Module, config: dict) -> None:
        import deepspeed

        self.engine, self.wrapper, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                               config=config)
        self.basic = getattr(self.wrapper, "optimizer", self.wrapper)
        self.kernel = type(self.basic).__name__
        self.acc: Phases | None = None

    def profile(self) -> Phases:
        """Wrap the phases (instance attributes shadow the methods the engine and wrapper look up)."""
        self.acc = acc = defaultdict(float)
        reducer = self.engine.reducer
        reducer.grad_ready = _timed(reducer.grad_ready, acc, "backward.hooks")
        reducer.finish = _timed(reducer.finish, acc, "backward.finish")
        self.basic.step = _timed(self.basic.step, acc, "step.optimizer")
        for attr, key in (("all_gather_params", "step.gather"), ("_global_norm", "step.norm"),
                          ("partitions_changed", "step.gather")):
            if hasattr(self.wrapper, attr):
                setattr(self.wrapper, attr, _timed(getattr(self.wrapper, attr), acc, key))
        scheduler = getattr(self.engine, "zero3_scheduler", None)
        if scheduler is not None:  # ZeRO-3: the hooks look these up on the instance at every call
            scheduler.fetch = _timed(scheduler.fetch, acc, "z3.fetch")
            scheduler.release = _timed(scheduler.release, acc, "z3.release")
            scheduler._wait_or_gather = _timed(scheduler._wait_or_gather, acc, "z3.gather")
        return acc

    def __call__(self, batch) -> None:
        acc, t0 = self.acc, time.perf_counter()
        loss = self.engine(batch)
        t1 = time.perf_counter()
        self.engine.backward(loss)
        t2 = time.perf_counter()
        self.engine.step()
        if acc is not None:
            acc["forward"] += t1 - t0
            acc["backward"] += t2 - t1
            acc["step"] += time.perf_counter() - t2


def build_variant(variant: str, model_name: str, args: argparse.Namespace):
    model = build_model(model_name, args)
    return DDPStep(model) if variant == "ddp" else EngineStep(model, ds_config(variant, model_name, args))


# ---- gloo collectives at the model's size (evidence for where stage 1/2's extra time goes) ---------------------
def _exchange(flat: torch.Tensor, rank: int, world: int, gather: bool) -> None:
    """Point-to-point all-gather (``gather``) or reduce-scatter of ``flat``'s equal partitions: every rank sends
    its partition (gather) or the others' slices (reduce-scatter) straight to the ranks that need them."""
    part = flat.numel() // world
    mine = flat[rank * part:(rank + 1) * part]
    recv = {r: (flat[r * part:(r + 1) * part] if gather else torch.empty(part)) for r in range(world) if r != rank}
    ops = []
    for r in recv:
        ops.append(dist.P2POp(dist.isend, mine if gather else flat[r * part:(r + 1) * part], r))
        ops.append(dist.P2POp(dist.irecv, recv[r], r))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if not gather:
        for buf in recv.values():
            mine.add_(buf)


def collectives(numel: int, rank: int, world: int, reps: int = 9) -> dict[str, float]:
    """Median ms of each way to move a ``numel``-element fp32 buffer (gradient reduction / weight gather)."""
    part = -(-numel // world)
    flat, out = torch.randn(part * world), torch.empty(part * world)

    def bcast() -> None:
        for r in range(world):
            dist.broadcast(flat[r * part:(r + 1) * part], src=r)

    cases = {"all_reduce (stage 0 gradient reduction)": lambda: dist.all_reduce(flat),
             "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out[:part], flat),
             "p2p reduce-scatter (isend/irecv + add)": lambda: _exchange(flat, rank, world, gather=False),
             "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, flat[rank * part:(rank + 1) * part]),
             "broadcast per owner (allgather_partitions: false)": bcast,
             "p2p all-gather (isend/irecv)": lambda: _exchange(flat, rank, world, gather=True)}
    result = {}
    for name, fn in cases.items():
        fn()
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result[name] = 1e3 * statistics.median(times)
    return result


# ---- the ranks ----------------------------------------------------------------------------------------------
def _time_steps(step, batches: list, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of this rank for ``steps`` steps, barrier to barrier."""
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(steps):
        step(batches[i % len(batches)])
    dist.barrier()
    return time.perf_counter() - start, time.process_time() - cpu_start


def _bench_model(model_name: str, args: argparse.Namespace, rank: int) -> dict:
    batches = make_batches(model_name, args, rank)
    steps = {v: build_variant(v, model_name, args) for v in args.variants}
    for step in steps.values():
        _time_steps(step, batches, args.warmup)
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in args.variants}
    names = list(args.variants)
    for rep in range(args.reps):
        shift = rep % len(names)  # rotate the order: no variant always runs first (warm caches) or last
        for v in names[shift:] + names[:shift]:
            times[v].append(_time_steps(steps[v], batches, args.steps))
    phases = {}
    if args.profile_steps > 0:
        for v, step in steps.items():
            acc = step.profile()
            _time_steps(step, batches, args.profile_steps)
            phases[v] = {k: 1e3 * s / args.profile_steps for k, s in acc.items()}
    model = build_model(model_name, args)
    return {"times": times, "phases": phases, "kernels": {v: s.kernel for v, s in steps.items()},
            "params": sum(p.numel() for p in model.parameters())}


def _rank_main(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world_size),
                      LOCAL_WORLD_SIZE=str(args.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    dist.init_process_group("gloo")
    results = {m: _bench_model(m, args, rank) for m in args.models}
    if args.collectives:
        with warnings.catch_warnings():  # the *_tensor names are deprecated aliases in recent torch
            warnings.simplefilter("ignore", FutureWarning)
            results["collectives"] = collectives(results[args.models[0]]["params"], rank, args.world_size)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()




def run(args: argparse.Namespace) -> dict:
    """Start the ranks; returns rank 0's results per model."""
    return spawn_ranks(_rank_main, args, args.world_size)


# ---- the report ---------------------------------------------------------------------------------------------




def _fmt_ratio(value: float | None) -> str:
    return f"{value:.3f}x" if value is not None else "-"


def timing_table(model: str, res: dict, args: argparse.Namespace) -> list[str]:
    """Step time and throughput per variant, with the ratios the targets are stated in."""
    wall = {v: [w for w, _ in ts] for v, ts in res["times"].items()}
    cpu = {v: [c for _, c in ts] for v, ts in res["times"].items()}
    samples = args.steps * micro_batch(model, args) * args.world_size
    med = {v: statistics.median(ws) / args.steps for v, ws in wall.items()}
    lines = [f"model {model}: {res['params'] / 1e6:.2f} M parameters, micro batch {micro_batch(model, args)}/rank",
             f"{'variant':<18} {'kernel':<16} {'ms/step':>8} {'samples/s':>9} {'/stage0':>8} {'paired':>8} "
             f"{'CPU paired':>10} {'stage0/ddp':>10} {'paired':>8}"]
    for v in wall:
        rate = samples / statistics.median(wall[v])
        vs0 = vs0p = vs0c = s0ddp = s0ddpp = None
        if "stage0" in wall and v not in ("ddp", "stage0"):
            vs0, vs0p, vs0c = (med[v] / med["stage0"], paired(wall[v], wall["stage0"]),
                               paired(cpu[v], cpu["stage0"]))
        if v == "stage0" and "ddp" in wall:
            s0ddp, s0ddpp = med["ddp"] / med["stage0"], paired(wall["ddp"], wall["stage0"])
        lines.append(f"{v:<18} {res['kernels'][v]:<16} {1e3 * med[v]:>8.2f} {rate:>9.1f} {_fmt_ratio(vs0):>8} "
                     f"{_fmt_ratio(vs0p):>8} {_fmt_ratio(vs0c):>10} {_fmt_ratio(s0ddp):>10} {_fmt_ratio(s0ddpp):>8}")
    return lines


PHASE_COLUMNS = ("forward", "backward", "backward.hooks", "backward.finish", "step", "step.optimizer", "step.norm",
                 "step.gather", "z3.fetch", "z3.gather", "z3.release")


def phase_table(phases: dict[str, dict[str, float]]) -> list[str]:
    """Profiled ms per step of each phase; 'kernel %' is the basic optimizer step's share of the whole step."""
    if not phases:
        return []
    short = {"backward.hooks": "bwd.hooks", "backward.finish": "bwd.finish", "step.optimizer": "opt.step",
             "step.norm": "norm", "step.gather": "gather", "z3.fetch": "z3.fetch", "z3.gather": "z3.gather",
             "z3.release": "z3.release"}
    head = f"{'variant':<18}" + "".join(f" {short.get(c, c):>10}" for c in PHASE_COLUMNS) + f" {'total':>8}"
    lines = ["profiled pass, ms per step (bwd.hooks/bwd.finish are inside backward; opt.step/norm/gather inside "
             "step; stage 3: gather = the step's release + re-gather of persistent parameters, z3.fetch (of which "
             "z3.gather: waiting for / running the gathers) and z3.release inside forward + backward):",
             head + f" {'kernel %':>8}"]
    for v, ph in phases.items():
        total = ph.get("forward", 0) + ph.get("backward", 0) + ph.get("step", 0)
        cells = "".join(f" {ph[c]:>10.2f}" if c in ph else f" {'-':>10}" for c in PHASE_COLUMNS)
        share = 100 * ph.get("step.optimizer", 0) / total if total else 0.0
        lines.append(f"{v:<18}{cells} {total:>8.2f} {share:>7.1f}%")
    return lines


def report(args: argparse.Namespace, results: dict) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"ZeRO step time: stages 0/1/2/2+offload/3 vs torch DDP, {args.world_size} gloo ranks, CPU, fp32",
             f"machine: {os.cpu_count()} cores ({cpu_model()}), torch {torch.__version__}, python "
             f"{platform.python_version()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
             f"load average (1 min) at the end {load:.2f}",
             f"{args.reps} interleaved reps x {args.steps} steps (after {args.warmup} warm-up); MLP "
             f"{args.mlp_layers}+1 x Linear({args.mlp_width}); GPT-2 {args.gpt_layers} layers, "
             f"n_embd {args.gpt_width}, "
             f"vocab {GPT2_VOCAB}, {args.seq} tokens", ""]
    coll = results.pop("collectives", None)
    for model, res in results.items():
        lines += timing_table(model, res, args) + [""] + phase_table(res["phases"]) + [""]
    if coll:
        base = coll["all_reduce (stage 0 gradient reduction)"]
        lines += [f"gloo collectives, fp32 buffer of {next(iter(results.values()))['params'] / 1e6:.2f} M elements, "
                  f"{args.world_size} ranks (median ms, ratio to all_reduce):"]
        lines += [f"  {name:<52} {ms:>8.2f} {ms / base:>6.2f}x" for name, ms in coll.items()] + [""]
    lines += ["ms/step, samples/s: medians over reps (wall clock, rank 0; samples/s global). /stage0: step time over",
              "stage 0's (lower is faster); paired: median of per-rep ratios to the adjacent run; CPU: process CPU",
              "time. stage0/ddp: stage 0 throughput over DDP's. Targets: stages 1, 2 <= 1.2x stage 0; stage 0 >= "
              "0.95x ddp; stage 3 <= 1.6x stage 0."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(report(args, run(args)))


if __name__ == "__main__":
    main()

"""The pipeline engine (``PipelineEngine.train_batch``, DeepSpeed's synchronous 1F1B ``TrainSchedule``): step time
against data parallelism, the pipeline bubble against theory, and activation memory of 1F1B against GPipe.

Model: an MLP of ``--layers`` x (``Linear(width, width)``, ``GELU``) and an MSE loss, whose per-layer matmuls
dominate the point-to-point traffic (one ``micro_batch x width`` fp32 activation per micro-batch and stage
boundary: 128 KiB at the defaults, against ~4 ms of forward and ~7 ms of backward per stage and micro-batch).
The pipeline is a ``PipelineModule`` of those layers (``partition_method="uniform"``: ``--layers`` / stages
Linear layers per stage); the baseline is the same layers as an ``nn.Sequential`` under plain
``deepspeed.initialize`` (both built after ``torch.manual_seed(0)``). fp32, the config's Adam (ds-ops
``FusedAdam``), gloo; every rank runs 1 torch thread (the harness's default). The ranks come from the shared
test harness (``tests/_harness.run_distributed``), one launch per world size; stages = world size.

1. Step time. Same global batch for every variant: ``m`` (``--m``) micro-batches of ``--micro_batch`` samples.
   ``pipeline, 1F1B``: ``engine.train_batch`` with ``gradient_accumulation_steps = m``. ``DP, same
   micro-batches``: the ``nn.Sequential`` data parallel over the same ranks, ``gradient_accumulation_steps =
   m / world`` micro-batches of ``--micro_batch`` per rank (``engine(x)``, ``engine.backward``, ``engine.step``
   per micro-batch; gradients all-reduced at the boundary). ``DP, one micro-batch``: the same samples as one
   micro-batch of ``m / world x micro_batch`` per rank (gas 1: DP's best case; small micro-batches cost more
   per sample, as each one's weight-gradient GEMMs write whole ``width x width`` gradients). Two more pipeline
   rows locate costs in the engine: ``eager sends`` runs ``EagerSend1F1B`` (below: DeepSpeed's 1F1B with each
   ``SendActivation`` issued right after its ``ForwardPass``) and ``seed_layers=True`` builds the
   ``PipelineModule`` with ``seed_layers=True``, which reseeds python/numpy/torch before every layer of every
   forward, as DeepSpeed does. Each repetition times one batch of each variant, in rotating order, after a
   barrier; a batch's time is the slowest rank's. Reported: median ms, and each variant / each DP baseline as
   the ratio of medians and the median of per-repetition ratios (paired).
2. Bubble. For each ``m`` in ``--bubble_m`` a pipeline engine with ``gradient_accumulation_steps = m`` runs
   ``--warmup`` untimed and ``--reps`` timed batches of DeepSpeed's 1F1B and of ``EagerSend1F1B``
   (alternating). The engine's instruction handlers are wrapped from outside
   (``deepspeed.runtime.pipe.engine._INSTRUCTIONS`` entries replaced, in the rank processes, by timing wrappers
   that call the originals; restored afterwards): every ``ForwardPass`` / ``BackwardPass`` (busy: the stage's
   layers, the loss, autograd) and the blocking ``RecvActivation`` / ``RecvGrad`` (waits) get a
   ``perf_counter`` start and end (``CLOCK_MONOTONIC``: one clock for every process on the machine). The
   batch's pipeline interval is [first ``ForwardPass`` start on any stage, last ``BackwardPass`` end on any
   stage] (stage 0's first forward to stage 0's last backward): loading the first micro-batch, the final
   gradient reduction and the optimizer step lie outside it. Measured bubble of stage s = 1 - busy_s /
   interval; the table shows the mean over stages, the largest and each stage, against the theory
   (p-1)/(m+p-1), which assumes every stage's forward and backward take equal times and communication is
   free. ``sim`` replays the batch with the measured duration of every forward and backward, the order each
   stage ran them, and only the pipeline's data dependencies (F(i, s) after F(i, s-1), B(i, s) after
   B(i, s+1)), with zero-cost communication: the bubble that stage imbalance alone explains; measured - sim is
   the cost of communication and synchronisation (``recv wait`` = time blocked in receives / interval). The
   last column gives each stage's mean forward / backward ms. Medians over repetitions.
3. Activation memory, by accounting: bytes of the tensors autograd saves for backward that are alive at
   once, per stage. While the engine's ``ForwardPass`` runs (wrapped as above) a
   ``torch.autograd.graph.saved_tensors_hooks`` pair packs every saved tensor into a small holder object and
   adds its storage's bytes (each storage once; the stage's parameters and their views excluded), and a
   ``weakref.finalize`` on the holder subtracts them when autograd drops it (the backward that used it ran, or
   the graph was freed). Peak per stage, in MiB and in micro-batches (peak / the bytes one forward saves on that
   stage), for 1F1B (``train_batch``) and for GPipe: ``GPipeSchedule`` below (all forwards, then all backwards
   in reverse order, then the reductions and the step; ``num_pipe_buffers() = m``). Both schedules of this
   script run through the engine's own ``train_batch`` -> ``engine._exec_schedule`` path: for that call only,
   the engine module's ``schedule`` name is pointed at a copy of ``ds_pipe.schedule`` whose ``TrainSchedule``
   is the script's class. Theory: 1F1B stage s holds min(p - s, m) micro-batches (forward of micro-batch i at
   step 2i+s, backward at 2i+2p-1-s), GPipe m. The GPipe batch is checked against the 1F1B batch from the
   same weights and data: same loss, parameters after the step within fp32 summation-order noise
   (``max |dparam|``).

gloo moves every message on background threads, which on a machine with as many busy ranks as cores wait for a
core: receives then take milliseconds, not the microseconds 128 KiB need. With more ranks than cores (4 ranks on
a 2-core machine) the stages also share cores: compute times stretch while several stages run at once, so the
bubble and step-time figures there describe an oversubscribed machine.
Run: ``python benchmarks/pipe.py`` (``--quick`` for a short run, ``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import logging
import os
import platform
import statistics
import sys
import time
import types
import weakref
from contextlib import contextmanager
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parents[1] / "tests")
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import paired  # noqa: E402 - benchmarks/ is on the path when this script runs
from _harness import run_distributed, shutdown_pool  # noqa: E402
from torch import nn  # noqa: E402

from ds_pipe import schedule  # noqa: E402

MB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes; stages = world size")
    parser.add_argument("--width", type=int, default=1024, help="Linear width")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (each followed by GELU); "
                        "a multiple of every world size")
    parser.add_argument("--micro_batch", type=int, default=32, help="samples per micro-batch")
    parser.add_argument("--m", type=int, default=8, help="micro-batches per batch for the step-time comparison "
                        "(a multiple of every world size)")
    parser.add_argument("--bubble_m", default="1,2,4,8", help="micro-batch counts of the bubble table")
    parser.add_argument("--mem_m", default="1,2,4,8", help="micro-batch counts of the memory table")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions (step time and bubble)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per engine first")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 3 reps, 1 warm-up batch")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.reps, args.warmup = "2", 3, 1
    args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    args.bubble_m = [int(m) for m in args.bubble_m.split(",") if m.strip()]
    args.mem_m = [int(m) for m in args.mem_m.split(",") if m.strip()]
    for w in args.worlds:
        if w < 2 or args.layers % w or args.m % w:
            parser.error(f"world size {w}: needs >= 2 ranks, --layers ({args.layers}) and --m ({args.m}) "
                         "multiples of it")
    for name in ("width", "micro_batch", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if min(args.bubble_m + args.mem_m) < 1:
        parser.error("micro-batch counts must be >= 1")
    return args


# ---- model, data, engines -----------------------------------------------------------------------------------
def specs(args: argparse.Namespace) -> list:
    from ds_pipe import LayerSpec

    out = []
    for _ in range(args.layers):
        out += [LayerSpec(nn.Linear, args.width, args.width), LayerSpec(nn.GELU)]
    return out


def micro_batches(args: argparse.Namespace, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``count`` micro-batches on every rank (the first and last stages must read the same ones)."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(args.micro_batch, args.width, generator=g),
             torch.randn(args.micro_batch, args.width, generator=g)) for _ in range(count)]


def config(micro: int, gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}


def pipe_engine(args: argparse.Namespace, m: int, seed_layers: bool = False):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    module = PipelineModule(specs(args), num_stages=dist.get_world_size(), loss_fn=nn.MSELoss(),
                            seed_layers=seed_layers, partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=module, config=config(args.micro_batch, m))
    return engine


def dp_engine(args: argparse.Namespace, micro: int, gas: int):
    import deepspeed

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=nn.Sequential(*[spec.build() for spec in specs(args)]),
                                      config=config(micro, gas))
    return engine


def dp_batch(engine, shard: list) -> None:
    loss_fn = nn.MSELoss()
    for x, y in shard:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()


def timed(fn) -> float:
    """Seconds ``fn()`` took on the slowest rank (started together after a barrier)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# ---- instrumentation of the engine's instruction handlers (from outside) --------------------------------------
@contextmanager
def wrapped_handlers(wrappers: dict):
    """Replace ``_INSTRUCTIONS[cls]`` by ``wrappers[cls](original)`` for the duration; restore afterwards."""
    from deepspeed.runtime.pipe import engine as pipe_engine_module

    table = pipe_engine_module._INSTRUCTIONS
    saved = dict(table)
    try:
        for cls, make in wrappers.items():
            table[cls] = make(saved[cls])
        yield
    finally:
        table.clear()
        table.update(saved)


def recording(kind: str, events: list):
    def make(original):
        def handler(engine, **kwargs):
            start = time.perf_counter()
            try:
                return original(engine, **kwargs)
            finally:
                events.append((kind, start, time.perf_counter()))
        return handler
    return make


class SavedTensorMeter:
    """Bytes of tensors saved for backward that are alive, each storage once, parameters excluded."""

    class Held:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    def __init__(self, params) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [holders alive, nbytes]
        self.bytes = self.peak = 0

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or storage.nbytes() == 0:
            return t
        held = self.Held(t)
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, storage.nbytes()]
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        else:
            entry[0] += 1
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, SavedTensorMeter.Held) else packed

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[key]


def metering(meter: SavedTensorMeter, per_forward: list):
    def make(original):
        def handler(engine, **kwargs):
            before = meter.bytes
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                out = original(engine, **kwargs)
            per_forward.append(meter.bytes - before)
            return out
        return handler
    return make


# ---- a GPipe schedule for the same engine ---------------------------------------------------------------------
class GPipeSchedule(schedule.PipeSchedule):
    """GPipe: every micro-batch forward, then every backward (last micro-batch first), then the reductions and
    the optimizer step; one buffer per micro-batch.

    Deadlock-free with the engine's non-blocking sends and blocking receives: a stage's only blocking operations
    are receives; it sends activations to s+1 in micro-batch order 0..m-1, which is the order s+1 receives them,
    and gradients to s-1 in the order m-1..0 in which s-1 receives them. The forward phase of stage s waits
    only on the forward phase of s-1 (which never waits on a later stage: its sends return at once), and the
    backward phase of s only on the backward phase of s+1, which starts once s+1's forwards are done: by
    induction over stages every receive is eventually matched. ``ReduceTiedGrads`` is the only collective
    over stages, reached by every stage at its last step."""

    def steps(self):
        has_prev, has_next = self._valid_stage(self.prev_stage), self._valid_stage(self.next_stage)
        for i in range(self.micro_batches):
            cmds: list[schedule.PipeInstruction] = []
            if has_prev:
                cmds.append(schedule.RecvActivation(i))
            if self.is_first_stage or self.is_last_stage:
                cmds.append(schedule.LoadMicroBatch(i))
            cmds.append(schedule.ForwardPass(i))
            if has_next:
                cmds.append(schedule.SendActivation(i))
            yield cmds
        for i in reversed(range(self.micro_batches)):
            cmds = []
            if has_next:
                cmds.append(schedule.RecvGrad(i))
            cmds.append(schedule.BackwardPass(i))
            if has_prev:
                cmds.append(schedule.SendGrad(i))
            yield cmds
        yield [schedule.ReduceTiedGrads(), schedule.ReduceGrads(), schedule.OptimizerStep()]

    def num_pipe_buffers(self) -> int:
        return self.micro_batches


class EagerSend1F1B(schedule.TrainSchedule):
    """DeepSpeed's 1F1B with each ``SendActivation`` moved from the next (backward) step to right after its
    ``ForwardPass``. DeepSpeed places it after the next step's ``RecvGrad`` so that blocking sends pair up, so
    stage s+1's forward of micro-batch i waits until stage s has received the gradient of an earlier
    micro-batch (at p = 2: the one stage s+1 has just sent, a round trip); with the engine's non-blocking
    sends nothing requires that. Same micro-batch order, same buffers, same receives."""

    def steps(self):
        has_next = self._valid_stage(self.next_stage)
        for cmds in super().steps():
            out: list[schedule.PipeInstruction] = []
            for cmd in cmds:
                if isinstance(cmd, schedule.SendActivation):
                    continue
                out.append(cmd)
                if isinstance(cmd, schedule.ForwardPass) and has_next:
                    out.append(schedule.SendActivation(cmd.buffer_id))
            yield out


@contextmanager
def train_schedule(cls):
    """``train_batch`` builds ``schedule.TrainSchedule(...)`` from the engine module's ``schedule`` name: point
    that name, for the duration, at a copy of the schedule module whose ``TrainSchedule`` is ``cls``."""
    from deepspeed.runtime.pipe import engine as pipe_engine_module

    original = pipe_engine_module.schedule
    pipe_engine_module.schedule = types.SimpleNamespace(**{**vars(schedule), "TrainSchedule": cls})
    try:
        yield
    finally:
        pipe_engine_module.schedule = original


def scheduled_batch(cls, engine, data) -> torch.Tensor:
    with train_schedule(cls):
        return engine.train_batch(data)


# ---- the rank body ----------------------------------------------------------------------------------------------
def rank_main(args: argparse.Namespace) -> dict:
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict = {"rank": rank}
    batches = micro_batches(args, max([args.m, *args.bubble_m, *args.mem_m]))

    # 1. step time: pipeline vs DP, same global batch, interleaved
    m = args.m
    pipe = pipe_engine(args, m)
    out["parts"] = list(pipe.module.parts)
    out["stage_params"] = sum(p.numel() for p in pipe.module.parameters())
    shard = batches[:m][rank::world]
    big = [(torch.cat([x for x, _ in shard]), torch.cat([y for _, y in shard]))]
    data = itertools.cycle(batches[:m])
    variants = {"pipe": (pipe, lambda e: e.train_batch(data)),
                "pipe_eager": (pipe, lambda e: scheduled_batch(EagerSend1F1B, e, data)),
                "pipe_seeded": (pipe_engine(args, m, seed_layers=True), lambda e: e.train_batch(data)),
                "dp": (dp_engine(args, args.micro_batch, m // world), lambda e: dp_batch(e, shard)),
                "dp1": (dp_engine(args, args.micro_batch * m // world, 1), lambda e: dp_batch(e, big))}
    for engine, run in variants.values():
        for _ in range(args.warmup):
            run(engine)
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            engine, run = variants[name]
            times[name].append(timed(lambda engine=engine, run=run: run(engine)))
    out["times"] = times
    del variants, pipe

    # 2. bubble: per-instruction timeline of every timed batch, DeepSpeed's 1F1B and the eager-send variant
    events: dict[int, dict[str, list]] = {}
    for m in args.bubble_m:
        engine = pipe_engine(args, m)
        data = itertools.cycle(batches[:m])
        for _ in range(args.warmup):
            engine.train_batch(data)
            scheduled_batch(EagerSend1F1B, engine, data)
        events[m] = {"1f1b": [], "eager": []}
        for _ in range(args.reps):
            for name, cls in (("1f1b", schedule.TrainSchedule), ("eager", EagerSend1F1B)):
                ev: list = []
                wrappers = {schedule.ForwardPass: recording("F", ev), schedule.BackwardPass: recording("B", ev),
                            schedule.RecvActivation: recording("recv", ev), schedule.RecvGrad: recording("recv", ev)}
                with wrapped_handlers(wrappers):
                    dist.barrier()
                    scheduled_batch(cls, engine, data)
                events[m][name].append(ev)
        del engine
    out["events"] = events

    # 3. saved-activation memory, 1F1B vs GPipe, same weights and data
    memory: dict[int, dict] = {}
    for m in args.mem_m:
        memory[m] = {}
        params_after = {}
        for name in ("1f1b", "gpipe"):
            engine = pipe_engine(args, m)
            meter, per_forward = SavedTensorMeter(engine.module.parameters()), []
            with wrapped_handlers({schedule.ForwardPass: metering(meter, per_forward)}):
                if name == "gpipe":
                    loss = scheduled_batch(GPipeSchedule, engine, iter(batches[:m]))
                else:
                    loss = engine.train_batch(iter(batches[:m]))
            memory[m][name] = {"peak": meter.peak, "per_forward": max(per_forward), "left": meter.bytes,
                               "loss": float(loss)}
            params_after[name] = [p.detach().clone() for p in engine.module.parameters()]
            del engine
        memory[m]["max_param_diff"] = max(float((a - b).abs().max())
                                          for a, b in zip(params_after["1f1b"], params_after["gpipe"], strict=True))
    out["memory"] = memory
    return out


# ---- analysis -----------------------------------------------------------------------------------------------------
def simulate(order: list[list[tuple[str, int]]], dur: dict) -> tuple[float, list[float]]:
    """Replay each stage's forwards/backwards in the order it ran them, with measured durations and only the
    pipeline's data dependencies (zero-cost communication). Returns (interval, busy per stage)."""
    p = len(order)
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    while any(pos[s] < len(order[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(order[s]):
                kind, i = order[s][pos[s]]
                dep = (("F", i, s - 1) if s > 0 else None) if kind == "F" else (("B", i, s + 1) if s < p - 1
                                                                                  else None)
                if dep is not None and dep not in end:
                    break
                start = max(free[s], end[dep] if dep is not None else 0.0)
                end[(kind, i, s)] = free[s] = start + dur[(kind, i, s)]
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("simulated schedule deadlocked")
    busy = [sum(dur[(k, i, s)] for k, i in order[s]) for s in range(p)]
    return max(free), busy


def bubble_stats(per_rank_events: list[list]) -> dict:
    """One batch: measured and simulated bubble per stage (ranks = stages)."""
    p = len(per_rank_events)
    compute = [[e for e in ev if e[0] in ("F", "B")] for ev in per_rank_events]
    start = min(e[1] for ev in compute for e in ev)
    stop = max(e[2] for ev in compute for e in ev)
    interval = stop - start
    busy = [sum(e[2] - e[1] for e in ev) for ev in compute]
    waits = [sum(e[2] - e[1] for e in ev if e[0] == "recv") for ev in per_rank_events]
    order, dur = [], {}
    for s, ev in enumerate(compute):
        count = {"F": 0, "B": 0}
        seq = []
        for kind, t0, t1 in ev:
            seq.append((kind, count[kind]))
            dur[(kind, count[kind], s)] = t1 - t0
            count[kind] += 1
        order.append(seq)
    sim_interval, sim_busy = simulate(order, dur)
    fwd = [statistics.mean(t1 - t0 for k, t0, t1 in ev if k == "F") for ev in compute]
    bwd = [statistics.mean(t1 - t0 for k, t0, t1 in ev if k == "B") for ev in compute]
    return {"interval": interval, "bubble": [1 - b / interval for b in busy],
            "sim": [1 - b / sim_interval for b in sim_busy], "wait": [w / interval for w in waits],
            "fwd": fwd, "bwd": bwd, "p": p}


def bubble_row(m: int, p: int, runs: list) -> str:
    """One row of the bubble table; ``runs`` = [1F1B, eager] x rank x repetition -> events."""
    stats = [[bubble_stats([rank[rep] for rank in per_rank]) for rep in range(len(per_rank[0]))]
             for per_rank in runs]

    def med(fn, which: int = 0) -> float:
        return statistics.median(fn(st) for st in stats[which])

    per_stage = " ".join(f"{med(lambda st, i=i: st['bubble'][i]):.3f}" for i in range(p))
    compute = "  ".join(f"{med(lambda st, i=i: st['fwd'][i]) * 1e3:.1f}/{med(lambda st, i=i: st['bwd'][i]) * 1e3:.1f}"
                        for i in range(p))
    return (f"{m:>3} | {(p - 1) / (m + p - 1):6.3f} | {med(lambda st: statistics.mean(st['bubble'])):5.3f} | "
            f"{med(lambda st: max(st['bubble'])):5.3f} | {per_stage:<24} | "
            f"{med(lambda st: statistics.mean(st['sim'])):5.3f} | {med(lambda st: statistics.mean(st['wait'])):9.3f} | "
            f"{med(lambda st: statistics.mean(st['bubble']), 1):5.3f} | "
            f"{med(lambda st: statistics.mean(st['wait']), 1):15.3f} | {med(lambda st: st['interval']) * 1e3:11.1f} | "
            f"{compute}")


def run(args: argparse.Namespace) -> dict:
    results = {}
    for world in args.worlds:
        started, load = time.perf_counter(), _load()
        ranks = run_distributed(rank_main, world_size=world, args=(args,), timeout=900)
        results[world] = (ranks, time.perf_counter() - started, (load, _load()))
    shutdown_pool()
    return results


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def report(args: argparse.Namespace, results: dict) -> str:
    load = _load()
    lines = [f"pipeline engine | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} | "
             f"cores {os.cpu_count()} | load avg {load:.1f} | torch {torch.__version__} | "
             f"Python {platform.python_version()} | gloo, 1 torch thread per rank",
             f"model: {args.layers} x (Linear({args.width}, {args.width}) + GELU) + MSE, fp32, Adam; micro-batch "
             f"{args.micro_batch} samples; {args.reps} reps after {args.warmup} warm-up batches"]
    for world, (ranks, wall, loads) in results.items():
        r0 = ranks[0]
        p = world
        lines += ["", f"== {world} ranks: pipeline = {p} stages x 1 pipeline, layer boundaries {r0['parts']}, "
                  f"{r0['stage_params'] / 1e6:.2f} M params on stage 0; took {wall:.0f} s, load avg {loads[0]:.1f} -> "
                  f"{loads[1]:.1f} =="]
        # 1. step time
        t = {k: [v * 1e3 for v in vs] for k, vs in r0["times"].items()}
        m = args.m
        med = {k: statistics.median(v) for k, v in t.items()}
        samples = m * args.micro_batch
        rows = [("pipeline, 1F1B: train_batch", f"{p} stages, gas {m} x {args.micro_batch}", "pipe"),
                ("pipeline, 1F1B, eager sends*", f"{p} stages, gas {m} x {args.micro_batch}", "pipe_eager"),
                ("pipeline, seed_layers=True**", f"{p} stages, gas {m} x {args.micro_batch}", "pipe_seeded"),
                ("DP, same micro-batches", f"{world} ranks, gas {m // world} x {args.micro_batch}", "dp"),
                ("DP, one micro-batch", f"{world} ranks, gas 1 x {m // world * args.micro_batch}", "dp1")]
        lines.append(f"1. step time, global batch {samples} samples ({m} micro-batches x {args.micro_batch}), "
                     f"slowest rank, median of {args.reps} interleaved reps")
        lines.append(f"{'variant':<30} | {'layout':<24} | {'ms/batch':>8} | {'samples/s':>9} | "
                     f"{'/ DP same mb (paired)':>21} | {'/ DP one mb (paired)':>20}")
        for label, layout, key in rows:
            cells = []
            for base in ("dp", "dp1"):
                ratio = paired(t[key], t[base])
                cells.append(f"{med[key] / med[base]:.3f}x ({ratio:.3f}x)")
            lines.append(f"{label:<30} | {layout:<24} | {med[key]:8.1f} | {samples / med[key] * 1e3:9.0f} | "
                         f"{cells[0]:>21} | {cells[1]:>20}")
        lines.append("   * SendActivation right after ForwardPass (EagerSend1F1B, this script) instead of after the "
                     "next step's RecvGrad")
        lines.append("  ** PipelineModule(seed_layers=True) reseeds python/numpy/torch before every layer of every "
                     "forward (DeepSpeed does too)")
        # 2. bubble
        lines.append("")
        lines.append(f"2. bubble = stage idle share of the pipeline interval, {p} stages, median of {args.reps} "
                     "batches; busy = ForwardPass + BackwardPass handler time; mean over stages unless named")
        lines.append(f"{'m':>3} | {'theory':>6} | {'1F1B':>5} | {'max':>5} | {'per stage':<24} | "
                     f"{'sim':>5} | {'recv wait':>9} | {'eager':>5} | {'eager recv wait':>15} | {'interval ms':>11} | "
                     "F / B ms per stage")
        for mm in args.bubble_m:
            lines.append(bubble_row(mm, p, [[rk["events"][mm][k] for rk in ranks] for k in ("1f1b", "eager")]))
        lines.append("   theory = (p-1)/(m+p-1); sim = replay of the measured forward/backward durations with free "
                     "communication (stage imbalance only); recv wait = RecvActivation + RecvGrad time / interval; "
                     "eager = EagerSend1F1B")
        # 3. memory
        lines.append("")
        lines.append("3. activation memory by accounting: peak bytes of tensors saved for backward alive at once "
                     "(parameters excluded), per stage, MiB (micro-batches = peak / one forward's saved bytes)")
        lines.append(f"{'m':>3} | {'stage':>5} | {'1 fwd MiB':>9} | {'1F1B peak MiB':>13} | {'1F1B mb':>7} | "
                     f"{'theory':>6} | {'GPipe peak MiB':>14} | {'GPipe mb':>8} | {'theory':>6} | "
                     f"{'GPipe/1F1B':>10} | {'same loss':>9} | {'max |dparam|':>12}")
        for mm in args.mem_m:
            for s, rk in enumerate(ranks):
                mem = rk["memory"][mm]
                a, g = mem["1f1b"], mem["gpipe"]
                unit = a["per_forward"]
                lines.append(
                    f"{mm:>3} | {s:>5} | {unit / MB:9.2f} | {a['peak'] / MB:13.2f} | {a['peak'] / unit:7.2f} | "
                    f"{min(p - s, mm):>6} | {g['peak'] / MB:14.2f} | {g['peak'] / g['per_forward']:8.2f} | "
                    f"{mm:>6} | {g['peak'] / a['peak']:9.2f}x | {str(a['loss'] == g['loss']):>9} | "
                    f"{mem['max_param_diff']:12.2e}")
            leftover = [rk["memory"][mm][k]["left"] for rk in ranks for k in ("1f1b", "gpipe")]
            if any(leftover):
                lines.append(f"    (saved bytes still alive after the batch: {leftover})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(report(args, run(args)))


if __name__ == "__main__":
    main()

"""Per-node launcher: starts this node's ranks of a (possibly multi-node) job.

The runner (``deepspeed`` command) calls this directly for a single node or with ``--no_ssh``; pdsh runs it as
``python -u -m deepspeed.launcher.launch --world_info=... --node_rank=%n ...`` on every node. Each rank gets
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, LOCAL_WORLD_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR and MASTER_PORT,
and ``--local_rank=N`` as its first argument unless ``--no_local_rank``. With ``--enable_elastic_training`` the
node runs torch's elastic agent instead (see :mod:`._elastic`). This module does not import torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from deepspeed.launcher._elastic import resolve_elastic_nodes, torchrun_command, unsupported_flags
from deepspeed.launcher._hostfile import HostfileError, decode_world_info
from deepspeed.launcher._procs import RankGroup, RankSpec
from deepspeed.launcher.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.launcher.resources import local_gpu_count, parse_core_list, split_cores


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the per-node launcher's command line."""
    parser = argparse.ArgumentParser(description="DeepSpeed per-node launcher: spawns this node's ranks.")
    parser.add_argument("--node_rank", type=int, default=0, help="index of this node in --world_info")
    parser.add_argument("--master_addr", default="127.0.0.1", type=str, help="address of the rank-0 node")
    parser.add_argument("--master_port", default=TORCH_DISTRIBUTED_DEFAULT_PORT, type=int,
                        help="free port on the rank-0 node used by torch.distributed")
    parser.add_argument("--world_info", default="None", type=str, help="base64 JSON {host: [slot, ...]}")
    parser.add_argument("--module", action="store_true", help="run the script as a module (python -m)")
    parser.add_argument("--no_python", action="store_true", help="run the script directly, not through python")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    parser.add_argument("--save_pid", type=int, default=0,
                        help="write /tmp/<save_pid>.deepspeed with the rank pids (0: do not)")
    parser.add_argument("--enable_each_rank_log", default="None", type=str,
                        help="directory for per-rank stdout/stderr logs (also prefixed on the console)")
    parser.add_argument("--bind_cores_to_rank", action="store_true",
                        help="bind each rank to its own share of the cores and set OMP_NUM_THREADS to match")
    parser.add_argument("--bind_core_list", type=str, default=None,
                        help="cores to share among the ranks, e.g. '1,3-5,7' (default: all cores we may use)")
    parser.add_argument("--enable_elastic_training", action="store_true",
                        help="run this node's ranks under torch's elastic agent (torch.distributed.run)")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1, help="Min number of nodes in elastic training.")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="Max number of nodes in elastic training.")
    parser.add_argument("training_script", type=str, help="the script (or module, or program) to run per rank")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(args)


def rank_command(args: argparse.Namespace, local_rank: int) -> list[str]:
    """argv of one rank: ``python -u [-m] script [--local_rank=N] args...``."""
    if args.no_python:
        if args.module:
            raise ValueError("--module and --no_python are mutually exclusive")
        cmd = [args.training_script]
    else:
        cmd = [sys.executable, "-u"] + (["-m"] if args.module else []) + [args.training_script]
    if not args.no_local_rank:
        cmd.append(f"--local_rank={local_rank}")
    return cmd + list(args.training_script_args)


def _world(args: argparse.Namespace) -> tuple[list[str], dict[str, list[int]]]:
    world_info = decode_world_info(args.world_info) if args.world_info != "None" else {"localhost": [0]}
    hosts = list(world_info)
    if not 0 <= args.node_rank < len(hosts):
        raise HostfileError(f"--node_rank={args.node_rank} is out of range: --world_info lists {len(hosts)} "
                            f"node(s) ({', '.join(hosts)}), accepted 0..{len(hosts) - 1}")
    return hosts, world_info


def elastic_spec(args: argparse.Namespace, base_env: dict[str, str]) -> RankSpec:
    """The one process of an elastic node: torch's elastic agent (torchrun) for this node's slots."""
    if unsupported_flags(args):
        raise ValueError(f"{', '.join(unsupported_flags(args))}: not supported with --enable_elastic_training")
    hosts, world_info = _world(args)
    low, high = resolve_elastic_nodes(args.min_elastic_nodes, args.max_elastic_nodes, len(hosts))
    local_slots = world_info[hosts[args.node_rank]]
    env = dict(base_env)
    if local_gpu_count() > 0:
        env["CUDA_VISIBLE_DEVICES"] = _visible_devices(local_slots, base_env.get("CUDA_VISIBLE_DEVICES"))
    env.setdefault("NCCL_ASYNC_ERROR_HANDLING", "1")  # as DeepSpeed's elastic agent
    cmd = torchrun_command(nproc_per_node=len(local_slots), min_nodes=low, max_nodes=high,
                           master_addr=args.master_addr, master_port=args.master_port,
                           script=args.training_script, script_args=args.training_script_args,
                           module=args.module, no_python=args.no_python)
    return RankSpec(0, cmd, env)


def build_rank_specs(args: argparse.Namespace, base_env: dict[str, str]) -> list[RankSpec]:
    """One RankSpec per local slot of node ``args.node_rank``; global ranks follow host order."""
    hosts, world_info = _world(args)
    first_rank = sum(len(world_info[h]) for h in hosts[: args.node_rank])
    world_size = sum(len(slots) for slots in world_info.values())
    local_slots = world_info[hosts[args.node_rank]]
    env = dict(base_env)
    if local_gpu_count() > 0:  # pin this node's ranks to the selected GPUs; LOCAL_RANK indexes this list
        env["CUDA_VISIBLE_DEVICES"] = _visible_devices(local_slots, base_env.get("CUDA_VISIBLE_DEVICES"))
    env.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port), WORLD_SIZE=str(world_size),
               LOCAL_SIZE=str(len(local_slots)), LOCAL_WORLD_SIZE=str(len(local_slots)),
               CROSS_RANK=str(args.node_rank), CROSS_SIZE=str(len(hosts)))
    log_dir = None if args.enable_each_rank_log == "None" else args.enable_each_rank_log
    cpus = _rank_cores(args, len(local_slots))
    specs = []
    for local_rank in range(len(local_slots)):
        rank = first_rank + local_rank
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(local_rank))
        if cpus[local_rank]:
            rank_env["OMP_NUM_THREADS"] = str(len(cpus[local_rank]))
        log_path = os.path.join(log_dir, f"rank{rank}") if log_dir else None
        specs.append(RankSpec(rank, rank_command(args, local_rank), rank_env, log_path, cpus[local_rank]))
    return specs


def _visible_devices(slots: list[int], visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for ``slots``: slot ids index an existing CUDA_VISIBLE_DEVICES list if one is set."""
    if not visible:
        return ",".join(str(s) for s in slots)
    ids = [d.strip() for d in visible.split(",")]
    if max(slots) >= len(ids):
        raise ValueError(f"slots {slots} do not fit CUDA_VISIBLE_DEVICES={visible!r} ({len(ids)} device(s))")
    return ",".join(ids[s] for s in slots)


def _rank_cores(args: argparse.Namespace, n_ranks: int) -> list[tuple[int, ...]]:
    """Cores of each local rank with --bind_cores_to_rank; empty tuples otherwise."""
    if not args.bind_cores_to_rank:
        if args.bind_core_list is not None:
            raise ValueError("--bind_core_list needs --bind_cores_to_rank")
        return [()] * n_ranks
    if args.bind_core_list is not None:
        cores = parse_core_list(args.bind_core_list)
    else:
        cores = sorted(os.sched_getaffinity(0))
    return split_cores(cores, n_ranks)


def _save_pids(launcher_pid: int, group: RankGroup) -> str:
    path = os.path.join("/tmp", f"{launcher_pid}.deepspeed")
    with open(path, "w", encoding="utf-8") as fd:
        fd.write(",".join(str(r.proc.pid) for r in group.ranks))
    return path


def main(args: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run this node's ranks with ``env`` (default: ours); returns 0, a failing rank's code, or 128+signal."""
    parsed = parse_args(args)
    if parsed.enable_elastic_training:
        return RankGroup([elastic_spec(parsed, dict(os.environ if env is None else env))], prefix_output=False).run()
    specs = build_rank_specs(parsed, dict(os.environ if env is None else env))
    if parsed.enable_each_rank_log != "None":
        os.makedirs(parsed.enable_each_rank_log, exist_ok=True)
    group = RankGroup(specs)
    if parsed.save_pid:
        group.on_started = lambda g: _save_pids(parsed.save_pid, g)
    return group.run()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, RuntimeError) as err:
        sys.stderr.write(f"deepspeed.launcher.launch: error: {err}\n")
        sys.exit(2)

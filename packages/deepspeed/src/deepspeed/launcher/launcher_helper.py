"""Per-rank wrapper used under mpirun: translate the launcher's rank variables, then exec the script.

DeepSpeed's MPICH runner starts every rank as ``python -u <dir>/launcher_helper.py --launcher mpich
[--module|--no_python] script args`` with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and LOCAL_SIZE in the
environment (``-genv``). The MPI flavours describe each rank with their own variables (PMI_RANK/PMIX_RANK and
MPI_LOCALRANKID/PALS_LOCAL_RANKID for MPICH and Intel MPI, OMPI_COMM_WORLD_*, MV2_COMM_WORLD_*, SLURM_*);
torch.distributed's env:// rendezvous wants RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so
this sets them and replaces itself with the user's program. Like DeepSpeed's helper it passes no
``--local_rank`` argument (the rank reads LOCAL_RANK) unless ``--local_rank_arg`` asks for it.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(
        os.path.realpath(__file__)):
    sys.path.pop(0)  # run as a file: this folder's modules must not shadow top-level ones

import argparse  # noqa: E402
import re  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402

from deepspeed.launcher.constants import (  # noqa: E402
    LAUNCHERS,
    MPICH_LAUNCHER,
    PDSH_LAUNCHER,
    TORCH_DISTRIBUTED_DEFAULT_PORT,
)

# launcher -> (rank, world size, local rank, local size) variable names, first present wins.
_RANK_VARS: dict[str, tuple[tuple[str, ...], ...]] = {
    "openmpi": (("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
                ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    "mpich": (("PMIX_RANK", "PMI_RANK"), ("PMI_SIZE", "PMIX_SIZE", "WORLD_SIZE"),
              ("PALS_LOCAL_RANKID", "MPI_LOCALRANKID"), ("MPI_LOCALNRANKS", "PALS_LOCAL_SIZE", "LOCAL_SIZE")),
    "impi": (("PMI_RANK", "PMIX_RANK"), ("PMI_SIZE", "WORLD_SIZE"), ("MPI_LOCALRANKID",),
             ("MPI_LOCALNRANKS", "LOCAL_SIZE")),
    "mvapich": (("MV2_COMM_WORLD_RANK", "PMI_RANK"), ("MV2_COMM_WORLD_SIZE", "PMI_SIZE"),
                ("MV2_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"), ("MV2_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")),
    "slurm": (("SLURM_PROCID",), ("SLURM_NTASKS",), ("SLURM_LOCALID",), ()),
}


def _slurm_local_size(env: Mapping[str, str]) -> str:
    """This node's task count from SLURM_TASKS_PER_NODE (``"4(x2),2"``) and SLURM_NODEID."""
    counts: list[str] = []
    for item in env.get("SLURM_TASKS_PER_NODE", "").split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match:
            counts += [match.group(1)] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    if node >= len(counts):
        raise RuntimeError(f"cannot find the task count of node {node} in "
                           f"SLURM_TASKS_PER_NODE={env.get('SLURM_TASKS_PER_NODE')!r}")
    return counts[node]


def rank_environment(launcher: str, env: Mapping[str, str], master_addr: str | None = None,
                     master_port: int | None = None) -> dict[str, str]:
    """``env`` plus RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

    ``master_addr``/``master_port`` default to the MASTER_ADDR/MASTER_PORT the launcher exported.
    """
    if launcher not in _RANK_VARS:
        raise ValueError(f"--launcher={launcher!r} has no rank variables; accepted: {', '.join(_RANK_VARS)}")
    values = []
    for names in _RANK_VARS[launcher]:
        found = next((env[n] for n in names if n in env), None)
        if found is None and names:
            raise RuntimeError(f"launcher '{launcher}' did not set any of {', '.join(names)}: was this process "
                               f"started by {launcher}?")
        values.append(found)
    rank, world, local_rank, local_size = values
    if local_size is None:
        local_size = _slurm_local_size(env)
    master_addr = master_addr or env.get("MASTER_ADDR")
    if not master_addr:
        raise RuntimeError(f"launcher '{launcher}': MASTER_ADDR is not set; pass --master_addr or export it")
    if master_port is None:
        master_port = int(env.get("MASTER_PORT", TORCH_DISTRIBUTED_DEFAULT_PORT))
    out = dict(env)
    out.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=local_rank, LOCAL_SIZE=local_size,
               LOCAL_WORLD_SIZE=local_size, MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    return out


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the helper's command line (DeepSpeed's: ``--launcher``, ``--module``, ``--no_python``, ...)."""
    parser = argparse.ArgumentParser(description="DeepSpeed per-rank helper for MPI and Slurm launchers.")
    parser.add_argument("--launcher", default=MPICH_LAUNCHER, type=str.lower,
                        choices=[n for n in LAUNCHERS if n != PDSH_LAUNCHER])
    parser.add_argument("--master_addr", default=None, type=str, help="default: $MASTER_ADDR")
    parser.add_argument("--master_port", default=None, type=int, help="default: $MASTER_PORT, else 29500")
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("--local_rank_arg", action="store_true", help="pass --local_rank=N to the script")
    parser.add_argument("--no_local_rank", action="store_true", help="accepted for compatibility (the default)")
    parser.add_argument("--bind_cores_to_rank", action="store_true", help="accepted; binding is the launcher's")
    parser.add_argument("--bind_core_list", type=str, default=None)
    parser.add_argument("user_script", type=str)
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    return parser.parse_args(args)


def build_exec(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment this rank execs into."""
    rank_env = rank_environment(args.launcher, env, args.master_addr, args.master_port)
    if args.no_python:
        cmd = [args.user_script]
    else:
        cmd = [sys.executable, "-u"] + (["-m"] if args.module else []) + [args.user_script]
    if args.local_rank_arg and not args.no_local_rank:
        cmd.append(f"--local_rank={rank_env['LOCAL_RANK']}")
    return cmd + list(args.user_args), rank_env


def main(args: Sequence[str] | None = None) -> None:
    """Replace this process with the user's program, in the rank environment."""
    cmd, env = build_exec(parse_args(args), os.environ)
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()

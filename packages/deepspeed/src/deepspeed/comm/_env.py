"""Where this rank learns its place: launcher variables, OpenMPI, MPICH/PMI or SLURM.

``discover_launch_env`` returns one consistent ``LaunchEnv`` from a single source (never a rank from one
scheduler and a world size from another) and ``export`` writes it back as ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` so ``env://`` rendezvous and later readers agree.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

# (source, rank var, world-size var, local-rank var, local-size var)
_SCHEDULERS = (
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # env | openmpi | mpich | slurm | single-process

    def export(self, environ: MutableMapping[str, str] = os.environ) -> None:
        environ["RANK"] = str(self.rank)
        environ["WORLD_SIZE"] = str(self.world_size)
        environ["LOCAL_RANK"] = str(self.local_rank)
        environ["MASTER_ADDR"] = self.master_addr
        environ["MASTER_PORT"] = str(self.master_port)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def expand_hostlist(spec: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu5"`` -> ``node01 node02 node03 node07 gpu5``."""
    spec = spec.strip()
    items = re.findall(r"(?:[^,\[\]]|\[[^\[\]]*\])+", spec)
    if not spec or ",".join(items) != spec:  # an unclosed, stray or nested bracket, or an empty item
        raise ValueError(f"SLURM host list {spec!r} is malformed (expected e.g. 'node[01-04,07],login1')")
    hosts: list[str] = []
    for item in items:
        expanded = [""]
        for literal, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [literal]
            if group:
                choices = [literal + value for value in _expand_range_group(group, spec)]
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        hosts.extend(expanded)
    return hosts


def _expand_range_group(group: str, spec: str) -> list[str]:
    values = []
    for part in group.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"SLURM host list {spec!r}: bad range {part!r} inside [{group}]")
        width = len(lo)  # zero padding is part of the host name: node[01-02] -> node01, node02
        values.extend(str(i).zfill(width) for i in range(int(lo), int(hi or lo) + 1))
    return values


def _scheduler_master(source: str, env: Mapping[str, str], world_size: int, local_size: int | None) -> str:
    """Rank 0's address when MASTER_ADDR is unset: SLURM's first node, else loopback on a single node."""
    if source == "slurm":
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if nodelist:
            return expand_hostlist(nodelist)[0]
    if local_size is not None and local_size == world_size:
        return "127.0.0.1"
    mpi_master = _mpi4py_master()
    if mpi_master is not None:
        return mpi_master
    raise ValueError(
        f"init_distributed: found {source} ranks spanning several nodes but MASTER_ADDR is unset and mpi4py is "
        f"not installed to ask rank 0 for its address; export MASTER_ADDR=<rank 0's host>"
    )


def _mpi4py_master() -> str | None:
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    return comm.bcast(socket.gethostbyname(socket.gethostname()) if comm.Get_rank() == 0 else None, root=0)


def _from_scheduler(env: Mapping[str, str], port: int) -> LaunchEnv | None:
    for source, rank_var, size_var, local_var, local_size_var in _SCHEDULERS:
        if rank_var not in env or size_var not in env:
            continue
        rank, world = _int(env, rank_var), _int(env, size_var)
        local_rank = _int(env, local_var) if local_var in env else 0
        local_size = _int(env, local_size_var) if local_size_var in env and env[local_size_var].isdigit() else None
        master = env.get("MASTER_ADDR") or _scheduler_master(source, env, world, local_size)
        master_port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else port
        return LaunchEnv(rank, world, local_rank, master, master_port, source)
    return None


def discover_launch_env(distributed_port: int, auto_mpi_discovery: bool = True,
                        environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """This rank's placement. Launcher variables win; then (``auto_mpi_discovery``) OpenMPI, MPICH, SLURM;
    with none of them the process is a single rank on ``127.0.0.1:distributed_port``."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        local_rank = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0
        master = environ.get("MASTER_ADDR") or ("127.0.0.1" if world == 1 else None)
        if master is None:
            raise ValueError("init_distributed: RANK and WORLD_SIZE are set but MASTER_ADDR is not; export it")
        port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else distributed_port
        return LaunchEnv(rank, world, local_rank, master, port, "env")
    if auto_mpi_discovery:
        found = _from_scheduler(environ, distributed_port)
        if found is not None:
            return found
    if "RANK" in environ or "WORLD_SIZE" in environ:
        missing = "WORLD_SIZE" if "RANK" in environ else "RANK"
        raise ValueError(f"init_distributed: {missing} is unset while the other launcher variable is set")
    return LaunchEnv(0, 1, 0, environ.get("MASTER_ADDR", "127.0.0.1"),
                     _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else distributed_port, "single-process")

"""Command lines that start a job on several nodes: pdsh (ssh), OpenMPI, MPICH, Intel MPI, MVAPICH and Slurm.

pdsh runs :mod:`deepspeed.launcher.launch` once per node (it spawns that node's ranks). The MPI launchers and
srun start every rank themselves; each rank goes through :mod:`deepspeed.launcher.launcher_helper`, which
turns the launcher's rank variables into RANK/LOCAL_RANK/WORLD_SIZE/... and then execs the user's script.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping

from deepspeed.launcher.constants import (
    IMPI_LAUNCHER,
    MPICH_LAUNCHER,
    MVAPICH_LAUNCHER,
    OPENMPI_LAUNCHER,
    PDSH_LAUNCHER,
    PDSH_MAX_FAN_OUT,
    SLURM_LAUNCHER,
)

Resources = Mapping[str, list[int]]


class MultiNodeRunner(ABC):
    """Builds the command that starts ``args.user_script`` on every node of ``active_resources``."""

    name = ""
    executable = ""  # program whose presence on PATH means the backend is installed

    def __init__(self, args: argparse.Namespace, world_info_base64: str):
        self.args = args
        self.world_info_base64 = world_info_base64
        self.user_script = args.user_script
        self.user_arguments = list(args.user_args)
        self.exports: dict[str, str] = {}
        self.validate_args()

    def backend_exists(self) -> bool:
        """Whether the launcher program is installed on this machine."""
        return shutil.which(self.executable) is not None

    def add_export(self, key: str, var: str) -> None:
        """Make ``key=var`` part of every rank's environment."""
        self.exports[key.strip()] = var.strip()

    def validate_args(self) -> None:
        """Reject options the backend command cannot take: here, unparsable ``--launcher_args``."""
        try:
            shlex.split(self.args.launcher_args)
        except ValueError as err:
            raise ValueError(f"--launcher_args {self.args.launcher_args!r} cannot be split like a shell "
                             f"would: {err}") from err

    @abstractmethod
    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        """argv that launches the job."""

    def _helper_cmd(self) -> list[str]:
        """Per-rank wrapper for MPI/Slurm: maps the launcher's rank variables, then runs the script."""
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launcher_helper", f"--launcher={self.name}",
               f"--master_addr={self.args.master_addr}", f"--master_port={self.args.master_port}"]
        cmd += [flag for flag in ("--module", "--no_python", "--no_local_rank") if getattr(self.args, flag[2:])]
        return cmd + [self.user_script] + self.user_arguments

    def _rank_exports(self) -> dict[str, str]:
        return {"MASTER_ADDR": str(self.args.master_addr), "MASTER_PORT": str(self.args.master_port), **self.exports}


def _check_contiguous_slots(name: str, active_resources: Resources) -> None:
    # MPI and srun place N ranks per host; they cannot pick particular slot ids.
    for host, slots in active_resources.items():
        if list(slots) != list(range(len(slots))):
            raise ValueError(f"launcher '{name}' starts ranks 0..N-1 on each host and cannot use slots {slots} "
                             f"of host {host!r}; use --launcher pdsh to select slots, or include whole hosts")


def _equal_ppn(name: str, active_resources: Resources) -> int:
    counts = {host: len(slots) for host, slots in active_resources.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"launcher '{name}' needs the same number of ranks on every host, got {counts}")
    return next(iter(counts.values()))


class PDSHRunner(MultiNodeRunner):
    """pdsh over ssh: one :mod:`deepspeed.launcher.launch` per node; pdsh replaces ``%n`` by the node's index."""

    name = PDSH_LAUNCHER
    executable = "pdsh"

    def launch_cmd(self) -> list[str]:
        """The per-node ``deepspeed.launcher.launch`` command (before the user's script)."""
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={self.world_info_base64}",
               "--node_rank=%n", f"--master_addr={self.args.master_addr}", f"--master_port={self.args.master_port}"]
        cmd += [flag for flag in ("--no_python", "--module", "--no_local_rank") if getattr(self.args, flag[2:])]
        if getattr(self.args, "bind_cores_to_rank", False):
            cmd.append("--bind_cores_to_rank")
            if self.args.bind_core_list is not None:
                cmd.append(f"--bind_core_list={self.args.bind_core_list}")
        return cmd

    def get_cmd(self, environment: dict[str, str], active_resources: Resources):
        """Returns ``(cmd, kill_cmd, environment)``; kill_cmd stops this job's launchers on every node."""
        environment["PDSH_RCMD_TYPE"] = "ssh"
        ssh_port = getattr(self.args, "ssh_port", None)
        if ssh_port is not None:
            environment["PDSH_SSH_ARGS_APPEND"] = f"{environment.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}"
        workers = ",".join(active_resources)
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", workers] + shlex.split(self.args.launcher_args)
        # pdsh hands one string to the remote shell: quote every piece that is not meant as shell syntax.
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in self.exports.items())
        remote = [exports + f"cd {shlex.quote(os.path.abspath('.'))};"]
        remote += [shlex.quote(a) for a in self.launch_cmd() + [self.user_script] + self.user_arguments]
        pattern = f"deepspeed.launcher.launch --world_info={self.world_info_base64}"
        kill_cmd = pdsh + ["pkill", "-f", shlex.quote(pattern)]
        return pdsh + remote, kill_cmd, environment


class OpenMPIRunner(MultiNodeRunner):
    """``mpirun`` of Open MPI; ranks read OMPI_COMM_WORLD_* through the launcher helper."""

    name = OPENMPI_LAUNCHER
    executable = "ompi_info"

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        _check_contiguous_slots(self.name, active_resources)
        total = sum(len(s) for s in active_resources.values())
        hosts = ",".join(f"{h}:{len(s)}" for h, s in active_resources.items())
        cmd = ["mpirun", "-n", str(total), "-H", hosts, "--mca", "btl", "^openib"]
        cmd += shlex.split(self.args.launcher_args)
        for key, val in self._rank_exports().items():
            cmd += ["-x", f"{key}={val}"]
        return cmd + self._helper_cmd()


class MPICHRunner(MultiNodeRunner):
    """Hydra ``mpirun`` of MPICH; ranks read PMI_RANK/MPI_LOCALRANKID through the launcher helper."""

    name = MPICH_LAUNCHER
    executable = "mpirun"

    def _env_args(self) -> list[str]:
        args: list[str] = []
        for key, val in self._rank_exports().items():
            args += ["-genv", key, val]
        return args

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        _check_contiguous_slots(self.name, active_resources)
        ppn = _equal_ppn(self.name, active_resources)
        total = ppn * len(active_resources)
        cmd = ["mpirun", "-n", str(total), "-ppn", str(ppn), "-hosts", ",".join(active_resources)]
        cmd += shlex.split(self.args.launcher_args) + self._env_args()
        return cmd + self._helper_cmd()


class IMPIRunner(MPICHRunner):
    """Intel MPI's ``mpirun`` (Hydra based, same options as MPICH)."""

    name = IMPI_LAUNCHER

    def backend_exists(self) -> bool:
        return shutil.which("mpirun") is not None and shutil.which("impi_info") is not None


class MVAPICHRunner(MPICHRunner):
    """MVAPICH2's Hydra ``mpirun``, with the MV2_* settings PyTorch ranks need."""

    name = MVAPICH_LAUNCHER
    executable = "mpiname"
    mv2_defaults = {"MV2_SMP_USE_CMA": "0", "MV2_DEBUG_SHOW_BACKTRACE": "1", "MV2_SUPPORT_DL": "1",
                    "MV2_ENABLE_AFFINITY": "0"}

    def __init__(self, args: argparse.Namespace, world_info_base64: str):
        super().__init__(args, world_info_base64)
        for key, val in self.mv2_defaults.items():
            self.add_export(key, val)

    def backend_exists(self) -> bool:
        if shutil.which("mpiname") is None:
            return False
        out = subprocess.run(["mpiname"], capture_output=True, text=True, check=False).stdout
        return "MVAPICH" in out.upper()


class SlurmRunner(MultiNodeRunner):
    """``srun``: one task per rank on the selected nodes; ranks read SLURM_PROCID/SLURM_LOCALID."""

    name = SLURM_LAUNCHER
    executable = "sinfo"

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        _check_contiguous_slots(self.name, active_resources)
        ppn = _equal_ppn(self.name, active_resources)
        cmd = ["srun", f"--nodes={len(active_resources)}", f"--ntasks={ppn * len(active_resources)}",
               f"--ntasks-per-node={ppn}", f"--nodelist={','.join(active_resources)}"]
        cmd += shlex.split(self.args.launcher_args)
        exports = self._rank_exports()
        bad = {k: v for k, v in exports.items() if "," in v}
        if bad:  # srun --export separates variables with ','
            raise ValueError(f"launcher 'slurm' cannot export values containing ',': {bad}")
        cmd.append("--export=" + ",".join(["ALL"] + [f"{k}={v}" for k, v in exports.items()]))
        return cmd + self._helper_cmd()


RUNNERS: dict[str, type[MultiNodeRunner]] = {
    r.name: r for r in (PDSHRunner, OpenMPIRunner, MPICHRunner, IMPIRunner, MVAPICHRunner, SlurmRunner)
}

"""Command lines that start a job on several nodes: pdsh (ssh), OpenMPI, MPICH, Intel MPI, MVAPICH and Slurm.

Constructors and command lines follow DeepSpeed's ``multinode_runner.py``: ``PDSHRunner(args, world_info_base64)``,
the others ``(args, world_info_base64, resource_pool)`` with ``resource_pool`` the hostfile's ``{host: slots}``.
pdsh runs :mod:`deepspeed.launcher.launch` once per node (it spawns that node's ranks). OpenMPI, MVAPICH and
srun start the user's script directly (``deepspeed.init_distributed`` reads their rank variables); MPICH goes
through ``launcher_helper.py`` (rank variables -> RANK/LOCAL_RANK); Intel MPI gets RANK/LOCAL_RANK per rank.

Where DeepSpeed's command would fail silently, ours differs (and only then):
- export values are passed raw to mpirun/srun (DeepSpeed wraps some in ``"..."``, which reaches the ranks
  literally); on pdsh's remote shell line every piece is ``shlex``-quoted, so an argument like ``a;b`` stays
  one argument (DeepSpeed only double-quotes arguments with spaces);
- pdsh's kill command stops this job's launchers only (DeepSpeed's pattern matches every DeepSpeed launcher
  on the nodes), and ``--bind_cores_to_rank``/``--bind_core_list`` reach the per-node launchers;
- MPICH's helper always runs under python (DeepSpeed's ``python -m <path>`` for ``--module`` and executing the
  ``.py`` file for ``--no_python`` cannot start); srun honours ``--module``/``--no_python``;
- srun refuses export values containing ',' (``--export`` separates variables with it).
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
    MVAPICH_TMP_HOSTFILE,
    OPENMPI_LAUNCHER,
    PDSH_LAUNCHER,
    PDSH_MAX_FAN_OUT,
    SLURM_LAUNCHER,
)
from deepspeed.launcher.resources import local_gpu_count, parse_core_list, split_cores

Resources = Mapping[str, list[int]]
HELPER_SCRIPT = os.path.join(os.path.dirname(os.path.realpath(__file__)), "launcher_helper.py")


def _opt(args: argparse.Namespace, name: str, default=None):
    """``args.<name>``, or ``default`` for a namespace built without that option (e.g. no ``launcher_args``)."""
    value = getattr(args, name, default)
    return default if value is None and default is not None else value


class MultiNodeRunner(ABC):
    """Builds the command that starts ``args.user_script`` on every node of ``active_resources``."""

    name = ""
    executable = ""  # program whose presence on PATH means the backend is installed

    def __init__(self, args: argparse.Namespace, world_info_base64: str):
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    def backend_exists(self) -> bool:
        """Whether the launcher program is installed on this machine."""
        return shutil.which(self.executable) is not None

    def add_export(self, key: str, var: str) -> None:
        """Make ``key=var`` part of every rank's environment."""
        self.exports[key.strip()] = var.strip()

    def parse_user_args(self) -> list[str]:
        return list(_opt(self.args, "user_args", []))

    def validate_args(self) -> None:
        """Reject options the backend command cannot take: here, unparsable ``--launcher_args``."""
        try:
            self.launcher_args()
        except ValueError as err:
            raise ValueError(f"--launcher_args {_opt(self.args, 'launcher_args', '')!r} cannot be split like a "
                             f"shell would: {err}") from err

    def launcher_args(self) -> list[str]:
        """``--launcher_args`` split like a shell would ([] when the namespace has none)."""
        return shlex.split(_opt(self.args, "launcher_args", ""))

    def python_exec(self) -> list[str]:
        """``python -u [-m]`` before the user's script, nothing with ``--no_python``."""
        if _opt(self.args, "no_python", False):
            return []
        return [sys.executable, "-u"] + (["-m"] if _opt(self.args, "module", False) else [])

    @abstractmethod
    def get_cmd(self, environment: dict[str, str], active_resources: Resources):
        """argv that launches the job."""


class _PoolRunner(MultiNodeRunner):
    """A backend that places ranks itself from the hostfile's resource pool (every MPI flavour, srun)."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def _reject_filters(self) -> None:
        # DeepSpeed's MPI runners place ranks from the whole hostfile: they cannot honour a resource filter.
        if _opt(self.args, "include", "") != "" or _opt(self.args, "exclude", "") != "":
            raise ValueError(f"{self.name} backend does not support worker include/exclusion")
        if _opt(self.args, "num_nodes", -1) != -1 or _opt(self.args, "num_gpus", -1) != -1:
            raise ValueError(f"{self.name} backend does not support limiting num nodes/gpus")

    def _equal_ppn(self) -> tuple[int, int]:
        """(total ranks, ranks per node) of the pool; hosts with different slot counts are an error."""
        counts = list(self.resource_pool.values())
        if not counts or any(n != counts[0] for n in counts):
            raise ValueError(f"launcher '{self.name}' needs the same number of ranks on every host, got "
                             f"{dict(self.resource_pool)}")
        return sum(counts), counts[0]


class PDSHRunner(MultiNodeRunner):
    """pdsh over ssh: one :mod:`deepspeed.launcher.launch` per node; pdsh replaces ``%n`` by the node's index."""

    name = PDSH_LAUNCHER
    executable = "pdsh"

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping | None = None):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def parse_user_args(self) -> list[str]:
        """pdsh hands one string to the remote shell: each argument is quoted to stay one argument."""
        return [shlex.quote(arg) for arg in super().parse_user_args()]

    def launch_cmd(self) -> list[str]:
        """The per-node ``deepspeed.launcher.launch`` command (before the user's script), as DeepSpeed's."""
        args = self.args
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={self.world_info_base64}",
               "--node_rank=%n", f"--master_addr={args.master_addr}", f"--master_port={args.master_port}"]
        cmd += [flag for flag in ("--no_python", "--module", "--no_local_rank") if _opt(args, flag[2:], False)]
        if _opt(args, "save_pid", False):
            cmd += ["--save_pid", f"{os.getpid()}"]
        each_rank_log = _opt(args, "enable_each_rank_log", "None")
        if each_rank_log:  # DeepSpeed passes the default "None" too; launch reads it as "off"
            cmd.append(f"--enable_each_rank_log={each_rank_log}")
        if _opt(args, "elastic_training", False):  # DeepSpeed's flags and order
            cmd += ["--enable_elastic_training", f"--max_elastic_nodes={_opt(args, 'max_elastic_nodes', -1)}",
                    f"--min_elastic_nodes={_opt(args, 'min_elastic_nodes', -1)}"]
        if _opt(args, "bind_cores_to_rank", False):
            cmd.append("--bind_cores_to_rank")
            if _opt(args, "bind_core_list") is not None:
                cmd.append(f"--bind_core_list={args.bind_core_list}")
        return cmd

    def get_cmd(self, environment: dict[str, str], active_resources: Resources):
        """Returns ``(cmd, kill_cmd, environment)``; kill_cmd stops this job's launchers on every node."""
        environment["PDSH_RCMD_TYPE"] = "ssh"
        ssh_port = _opt(self.args, "ssh_port")
        if ssh_port is not None:
            environment["PDSH_SSH_ARGS_APPEND"] = f"{environment.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}"
        workers = ",".join(active_resources)
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", workers] + self.launcher_args()
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in self.exports.items())
        launch = [exports, f"cd {shlex.quote(os.path.abspath('.'))};"]
        launch += [shlex.quote(a) for a in self.launch_cmd() + [self.user_script]]
        pattern = f"deepspeed.launcher.launch --world_info={self.world_info_base64}"
        kill_cmd = pdsh + ["pkill", "-f", shlex.quote(pattern)]
        return pdsh + launch + self.user_arguments, kill_cmd, environment


class OpenMPIRunner(_PoolRunner):
    """Open MPI's ``mpirun`` over the hostfile; ranks read OMPI_COMM_WORLD_* in ``init_distributed``."""

    name = OPENMPI_LAUNCHER
    executable = "ompi_info"

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]):
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("UCX_TLS", "tcp")

    def validate_args(self) -> None:
        super().validate_args()
        self._reject_filters()

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        total = sum(self.resource_pool.values())
        launcher_args = self.launcher_args()
        # DeepSpeed adds `--mca btl_tcp_if_include eth0` unless launcher_args set btl_tcp_if_include themselves.
        given = any(a in ("-mca", "--mca") and b == "btl_tcp_if_include"
                    for a, b in zip(launcher_args, launcher_args[1:], strict=False))
        btl_tcp = [] if given else ["--mca", "btl_tcp_if_include", "eth0"]
        cmd = ["mpirun", "-n", str(total), "-hostfile", str(self.args.hostfile), "--mca", "btl", "^openib"]
        cmd += btl_tcp + launcher_args
        for key, val in self.exports.items():
            cmd += ["-x", f"{key}={val}"]
        return cmd + self.python_exec() + [self.user_script] + self.user_arguments


class MPICHRunner(_PoolRunner):
    """Hydra ``mpirun`` of MPICH; each rank starts ``launcher_helper.py``, which maps PMI_RANK/MPI_LOCALRANKID."""

    name = MPICH_LAUNCHER
    executable = "mpirun"

    def validate_args(self) -> None:
        super().validate_args()
        self._reject_filters()

    def _job_env(self, total: int, ppn: int) -> list[str]:
        args = self.args
        return ["-genv", "MASTER_ADDR", str(args.master_addr), "-genv", "MASTER_PORT", str(args.master_port),
                "-genv", "WORLD_SIZE", str(total), "-genv", "LOCAL_SIZE", str(ppn)]

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        total, ppn = self._equal_ppn()
        cmd = ["mpirun", "-n", str(total), "-ppn", str(ppn)] + self.launcher_args()
        for key, val in self.exports.items():
            cmd += ["-genv", f"{key}={val}"]
        cmd += self._job_env(total, ppn) + ["-hosts", ",".join(self.resource_pool)]
        helper = [HELPER_SCRIPT, "--launcher", _opt(self.args, "launcher", self.name)]
        if _opt(self.args, "no_python", False):
            helper.append("--no_python")
        elif _opt(self.args, "module", False):
            helper.append("--module")
        return cmd + [sys.executable, "-u"] + helper + [self.user_script] + self.user_arguments


class IMPIRunner(MPICHRunner):
    """Intel MPI's ``mpirun``: one ``-n 1`` block per rank carrying its RANK and LOCAL_RANK."""

    name = IMPI_LAUNCHER

    def backend_exists(self) -> bool:
        return shutil.which("mpirun") is not None and shutil.which("impi_info") is not None

    def _rank_cores(self, ppn: int) -> list[tuple[int, ...]] | None:
        """Each local rank's cores with ``--bind_cores_to_rank`` (None without it)."""
        if not _opt(self.args, "bind_cores_to_rank", False):
            return None
        core_list = _opt(self.args, "bind_core_list")
        cores = parse_core_list(core_list) if core_list is not None else list(range(os.cpu_count() or 1))
        return split_cores(cores, ppn)

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        total, ppn = self._equal_ppn()
        cmd = ["mpirun", "-ppn", str(ppn)] + self.launcher_args()
        for key, val in self.exports.items():
            cmd += ["-genv", key, val]
        rank_cores = self._rank_cores(ppn)
        if rank_cores is not None:
            cmd += ["-genv", "OMP_NUM_THREADS", str(len(rank_cores[0]))]
        cmd += self._job_env(total, ppn) + ["-genv", "I_MPI_PIN", "0"]  # DeepSpeed binds, not Intel MPI
        cmd += ["-hosts", ",".join(self.resource_pool)]
        for rank in range(total):
            local_rank = rank % ppn
            numactl = [] if rank_cores is None else ["numactl", "-C", _core_ranges(rank_cores[local_rank])]
            block = ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(local_rank)]
            cmd += ([":"] if rank else []) + block + numactl + self.python_exec()
            cmd += [self.user_script] + self.user_arguments
        return cmd


def _core_ranges(cores: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"`` (numactl's -C syntax)."""
    parts: list[str] = []
    start = prev = cores[0]
    for core in (*cores[1:], None):
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(parts)


class MVAPICHRunner(_PoolRunner):
    """MVAPICH2's ``mpirun`` with a temporary hostfile and the MV2_* settings PyTorch ranks need."""

    name = MVAPICH_LAUNCHER
    executable = "mpiname"

    def __init__(self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]):
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("MV2_SMP_USE_CMA", "0")  # the CMA kernel module is missing on Ubuntu
        self.add_export("MV2_DEBUG_SHOW_BACKTRACE", "1")
        if local_gpu_count() > 0:  # DeepSpeed: when the accelerator is CUDA (counted without importing torch)
            self.add_export("MV2_USE_CUDA", "1")
        self.add_export("MV2_SUPPORT_DL", "1")
        self.add_export("MV2_ENABLE_AFFINITY", "0")  # MPI_THREAD_MULTIPLE
        self.add_export("MV2_INTER_ALLGATHER_TUNING", "5")
        self.add_export("MV2_CUDA_USE_NAIVE", "0")

    def backend_exists(self) -> bool:
        if shutil.which("mpiname") is None:
            return False
        out = subprocess.run(["mpiname"], capture_output=True, text=True, check=False).stdout
        return "MVAPICH" in out.upper()

    def validate_args(self) -> None:
        super().validate_args()
        self._reject_filters()

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        total, ppn = self._equal_ppn()
        with open(MVAPICH_TMP_HOSTFILE, "w", encoding="utf-8") as fd:
            fd.writelines(f"{host}\n" for host in self.resource_pool)
        cmd = ["mpirun", "-np", str(total), "-ppn", str(ppn), "--hostfile", MVAPICH_TMP_HOSTFILE]
        cmd += self.launcher_args()
        for key, val in self.exports.items():
            cmd += ["-env", f"{key}={val}"]
        return cmd + self.python_exec() + [self.user_script] + self.user_arguments


class SlurmRunner(_PoolRunner):
    """``srun``: one task per rank; ranks read SLURM_PROCID/SLURM_LOCALID in ``init_distributed``."""

    name = SLURM_LAUNCHER
    executable = "sinfo"

    @classmethod
    def validate_active_resources(cls, active_resources: Resources) -> None:
        """srun places N tasks per host: it cannot pick slot ids nor give hosts different counts."""
        counts = {host: len(slots) for host, slots in active_resources.items()}
        for host, slots in active_resources.items():
            if list(slots) != list(range(len(slots))):
                raise ValueError(f"slurm backend cannot select specific device ids, got {list(slots)} on {host}. "
                                 "Filter whole hosts, or keep the first N slots on every host.")
        if len(set(counts.values())) > 1:
            raise ValueError(f"slurm backend needs the same slot count on every host, got {counts}.")

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        self.validate_active_resources(active_resources)
        args = self.args
        total = sum(len(slots) for slots in active_resources.values())
        cmd = ["srun", "-n", str(total)] + self.launcher_args()
        if _opt(args, "slurm_comment", ""):
            cmd += ["--comment", args.slurm_comment]
        if _opt(args, "include", "") or _opt(args, "exclude", ""):  # already resolved into active_resources
            cmd += ["--nodelist", ",".join(active_resources), "--nodes", str(len(active_resources))]
        if _opt(args, "num_nodes", -1) > 0:
            cmd += ["--nodes", str(args.num_nodes)]
        if _opt(args, "num_gpus", -1) > 0:
            cmd += ["--gpus-per-node", str(args.num_gpus)]
        bad = {k: v for k, v in self.exports.items() if "," in v}
        if bad:  # srun --export separates variables with ','
            raise ValueError(f"launcher 'slurm' cannot export values containing ',': {bad}")
        cmd.append("--export=" + ",".join(["ALL"] + [f"{k}={v}" for k, v in self.exports.items()]))
        return cmd + self.python_exec() + [self.user_script] + self.user_arguments


RUNNERS: dict[str, type[MultiNodeRunner]] = {
    r.name: r for r in (PDSHRunner, OpenMPIRunner, MPICHRunner, IMPIRunner, MVAPICHRunner, SlurmRunner)
}

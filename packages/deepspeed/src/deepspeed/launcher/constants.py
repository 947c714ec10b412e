"""Names and defaults shared by the launcher modules (DeepSpeed's ``deepspeed.launcher.constants``)."""

from __future__ import annotations

import os

PDSH_LAUNCHER = "pdsh"
PDSH_MAX_FAN_OUT = 1024

OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"
MVAPICH_TMP_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"

LAUNCHERS = (PDSH_LAUNCHER, OPENMPI_LAUNCHER, MPICH_LAUNCHER, IMPI_LAUNCHER, SLURM_LAUNCHER, MVAPICH_LAUNCHER)

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
DLTS_HOSTFILE = "/job/hostfile"

# Variables whose name starts with one of these prefixes travel to the remote nodes.
EXPORT_ENVS = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
# When the key is set in the launcher's environment, the listed variables are not exported (cluster-specific).
EXCLUDE_ENVS = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = (os.path.expanduser("~"), ".")

"""What the launcher learns from the local machine and files, without importing torch.

Start-up time matters (the ranks import torch, the launcher should not), so GPUs are counted from the NVIDIA
driver's /proc entries and CUDA_VISIBLE_DEVICES, and CPU "slots" default to the number of NUMA nodes (what
DeepSpeed's CPU accelerator reports).
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable, Mapping

from deepspeed.launcher.constants import DEEPSPEED_ENVIRONMENT_NAME, EXCLUDE_ENVS, EXPORT_ENVS

logger = logging.getLogger("deepspeed.launcher")


def local_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """Number of CUDA GPUs this process may use (0 on a CPU-only machine)."""
    environ = os.environ if environ is None else environ
    physical = len(glob.glob("/proc/driver/nvidia/gpus/*")) or len(glob.glob("/dev/nvidia[0-9]*"))
    if physical == 0:
        return 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])


_NUMA_ROOT = "/sys/devices/system/node"


def _parse_cpulist(text: str) -> list[int]:
    """Kernel cpulist ``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (empty text: no cores)."""
    cores: list[int] = []
    for item in text.strip().split(","):
        if item:
            lo, _, hi = item.partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
    return cores


def numa_core_lists(root: str = _NUMA_ROOT) -> list[list[int]]:
    """Cores of each NUMA node in node order, from sysfs (what ``numactl --hardware`` prints); [] if unknown."""
    nodes = []
    for path in glob.glob(os.path.join(root, "node[0-9]*")):
        try:
            with open(os.path.join(path, "cpulist")) as f:
                nodes.append((int(os.path.basename(path)[4:]), _parse_cpulist(f.read())))
        except (OSError, ValueError):
            return []
    return [cores for _, cores in sorted(nodes)]


def numa_accelerator_count(core_lists: list[list[int]]) -> int:
    """DeepSpeed's CPU device count without LOCAL_SIZE: NUMA nodes that own cores, a run of nodes with the
    same cores (fake NUMA) counted once, nodes without cores (flat-mode HBM) skipped; 1 when unknown."""
    count, previous = 0, None
    for cores in core_lists:
        if cores and cores != previous:
            count += 1
            previous = cores
    return count or 1


def local_size(environ: Mapping[str, str]) -> int:
    """``LOCAL_SIZE`` as a positive int, or 0 when unset or <= 0; a non-integer value is an error naming it."""
    raw = environ.get("LOCAL_SIZE", "").strip()
    if not raw:
        return 0
    try:
        return max(int(raw), 0)
    except ValueError:
        raise ValueError(f"LOCAL_SIZE={raw!r} is not an integer (the number of ranks on this host)") from None


def local_cpu_slots(environ: Mapping[str, str] | None = None) -> int:
    """Default number of CPU ranks per node, as DeepSpeed's CPU accelerator counts devices: LOCAL_SIZE if
    set, else the NUMA nodes with cores (at least 1)."""
    environ = os.environ if environ is None else environ
    return local_size(environ) or numa_accelerator_count(numa_core_lists())


def local_slot_count(environ: Mapping[str, str] | None = None) -> int:
    """Slots of the local node when no hostfile is given: GPUs, or CPU ranks without GPUs."""
    return local_gpu_count(environ) or local_cpu_slots(environ)


def exported_environment(env: Mapping[str, str], prefixes: Iterable[str] = EXPORT_ENVS) -> dict[str, str]:
    """The variables of ``env`` that remote ranks must see (NCCL_*, PYTHON*, UCX_*, ...), minus cluster excludes."""
    excluded = {name for key, names in EXCLUDE_ENVS.items() if key in env for name in names}
    prefixes = tuple(prefixes)
    return {k: v for k, v in env.items() if k.startswith(prefixes) and k not in excluded}


def read_deepspeed_env(paths: Iterable[str], name: str = DEEPSPEED_ENVIRONMENT_NAME) -> dict[str, str]:
    """``KEY=VALUE`` lines of ``<path>/.deepspeed_env`` for each path in order (later files win).

    Blank lines and ``#`` comments are skipped; any other line without ``=`` is an error quoting it.
    """
    exports: dict[str, str] = {}
    seen: set[str] = set()
    for directory in paths:
        env_file = os.path.realpath(os.path.join(directory, name))
        if env_file in seen or not os.path.isfile(env_file):
            continue
        seen.add(env_file)
        logger.info("deepspeed_env file = %s", env_file)
        with open(env_file, encoding="utf-8") as fd:
            for lineno, raw in enumerate(fd, start=1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                key, sep, value = line.partition("=")
                key = key.strip()
                if key.startswith("export "):
                    key = key[len("export "):].strip()
                if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
                    raise ValueError(f"{env_file}:{lineno}: bad line {raw.rstrip()!r}: expected KEY=VALUE")
                exports[key] = value.strip()
    return exports


def parse_core_list(text: str) -> list[int]:
    """``"1,3-5,7"`` -> ``[1, 3, 4, 5, 7]`` (``--bind_core_list``); errors quote the bad item."""
    cores: list[int] = []
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"--bind_core_list {text!r}: bad item {item!r}; expected numbers and ranges "
                             "like '1,3-5,7'")
        cores += range(int(lo), int(hi if sep else lo) + 1)
    return sorted(set(cores), key=cores.index)


def split_cores(cores: list[int], n_ranks: int) -> list[tuple[int, ...]]:
    """Give each of ``n_ranks`` ranks an equal, contiguous share of ``cores`` (the remainder stays unused)."""
    per_rank = len(cores) // n_ranks
    if per_rank == 0:
        raise ValueError(f"cannot bind {n_ranks} ranks to {len(cores)} core(s) {cores}: need one core per rank")
    return [tuple(cores[i * per_rank:(i + 1) * per_rank]) for i in range(n_ranks)]

"""``deepspeed.utils.numa``: DeepSpeed's NUMA helpers for binding CPU ranks with ``numactl``.

``get_numa_cores`` reads the cores of each NUMA node from sysfs through the launcher's ``numa_core_lists`` (the
same lists ``numactl --hardware`` prints, without needing numactl installed). ``get_numactl_cmd`` builds the
``numactl -m <node> -C <cores>`` prefix of one local rank exactly as DeepSpeed 0.19 does (flat-mode HBM nodes
bound with ``-p``, fake-NUMA node groups with ``-m a,b``). No torch import: the launcher may use it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

from deepspeed.launcher.resources import numa_core_lists

__all__ = ["check_for_numactl_pkg", "get_numa_cores", "get_numactl_cmd", "parse_range", "parse_range_list"]


def get_numa_cores() -> list[list[int]]:
    """The cores of each NUMA node, node by node (``[]`` when the machine does not say)."""
    return numa_core_lists()


def check_for_numactl_pkg() -> bool:
    """Whether the system package manager (dpkg, pacman or rpm, the first found) has numactl installed; prints
    how to install it when not."""
    managers = {"dpkg": ("-l", "apt"), "pacman": ("-Q", "pacman"), "rpm": ("-q", "yum")}
    for manager, (flag, tool) in managers.items():
        if shutil.which(manager) is None:
            continue
        done = subprocess.run([manager, flag, "numactl"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if done.returncode == 0:
            return True
        print(f"please install the numactl package with {tool}")
        return False
    return False


def parse_range(rng: str) -> range:
    """``"5"`` -> ``range(5, 6)``, ``"2-4"`` -> ``range(2, 5)`` (both ends included)."""
    if rng.strip().isdigit():
        value = int(rng)
        return range(value, value + 1)
    parts = rng.split("-")
    if len(parts) != 2:
        raise ValueError(f"Bad range: '{rng}', range must be either a number or two number separated by dash")
    start, end = int(parts[0]), int(parts[1])
    if start > end:
        raise ValueError(f"Bad range: '{rng}', range end must larger than or equal to start")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``: comma-separated numbers and ranges, ascending and not overlapping."""
    numbers: list[int] = []
    last = -1
    for sub_range in range_str.split(","):
        values = parse_range(sub_range)
        if values[0] <= last:
            raise ValueError(f"Bad range: '{range_str}', sub ranges must not overlap with each other and should be "
                             "in ascend order")
        last = values[-1]
        numbers.extend(values)
    return numbers


def _physical_core_count() -> int:
    try:
        import psutil
    except ImportError:  # psutil is optional here: fall back to the logical CPUs
        return os.cpu_count() or 1
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def _memory_binding(rank_cores: Sequence[int], numa_cores: list[list[int]]) -> list[str]:
    """``-m <node>`` (or ``-p <hbm node>``, ``-m <fake-numa group>``) for cores that all sit on one node."""
    empty = [i for i, cores in enumerate(numa_cores) if not cores]
    filled = [i for i, cores in enumerate(numa_cores) if cores]
    groups: list[list[int]] = []  # runs of consecutive nodes listing the same cores (fake NUMA)
    for i in range(1, len(numa_cores)):
        if numa_cores[i] and numa_cores[i] == numa_cores[i - 1]:
            if groups and groups[-1][-1] == i - 1:
                groups[-1].append(i)
            else:
                groups.append([i - 1, i])
    homes = [i for i, cores in enumerate(numa_cores) if set(rank_cores) <= set(cores)]
    if not homes:
        return []
    if empty and len(empty) == len(filled):  # flat-mode HBM: each core node pairs with a memory-only node
        return ["-p", str(dict(zip(filled, empty, strict=True))[homes[0]])]
    if groups:
        group = next((g for home in homes for g in groups if home in g), None)
        return [] if group is None else ["-m", ",".join(map(str, group))]
    return ["-m", str(homes[0])]


def _core_string(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def get_numactl_cmd(bind_core_list: str | None, num_local_procs: int, local_rank: int) -> tuple[int, list[str]]:
    """``(cores_per_rank, numactl prefix)`` for ``local_rank`` of ``num_local_procs`` ranks on this host.

    Each rank gets an equal, contiguous share of ``bind_core_list`` (``"0-3,8"``; default: the physical cores),
    bound with ``-C``, plus its NUMA node's memory when all its cores sit on one node.
    """
    check_for_numactl_pkg()
    if "KMP_AFFINITY" in os.environ:
        raise ValueError("Environment variable KMP_AFFINITY conflicts with numactl because it interfere with how "
                         "many CPU cores numactl can set. Unset KMP_AFFINITY before launching deepspeed.\n\n"
                         "\t$ unset KMP_AFFINITY\n\t$ deepspeed <deepspeed command parameters>")
    core_list = parse_range_list(bind_core_list) if bind_core_list is not None else list(range(_physical_core_count()))
    cores_per_rank = len(core_list) // num_local_procs
    if cores_per_rank < 1:
        raise ValueError(f"At least one core needs to be assigned to each rank: {len(core_list)} core(s) for "
                         f"{num_local_procs} local rank(s)")
    rank_cores = core_list[cores_per_rank * local_rank:cores_per_rank * (local_rank + 1)]
    numactl_cmd = ["numactl", *_memory_binding(rank_cores, get_numa_cores()), "-C", _core_string(rank_cores)]
    return cores_per_rank, numactl_cmd

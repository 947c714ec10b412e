"""Elastic mode (``--elastic_training``): each node's workers run under torch's own elastic agent.

DeepSpeed started a ``DSElasticAgent`` (a ``LocalElasticAgent`` subclass) with a c10d rendezvous at
``master_addr:master_port``, ``min_nodes..max_nodes`` and ``max_restarts=100``. We run the same thing through
torch's command line, ``python -m torch.distributed.run`` (torchrun), so the agent is torch's, unchanged. The
per-node launcher (:mod:`.launch`) builds the command; the runner validates the flags first. No torch import.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence

ELASTIC_TRAINING_ID_DEFAULT = "123456789"  # DeepSpeed's rendezvous id; ELASTIC_RUN_ID overrides it
ELASTIC_MAX_RESTARTS = 100  # DeepSpeed's WorkerSpec(max_restarts=100)
_CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")

logger = logging.getLogger("deepspeed.launcher")


def resolve_elastic_nodes(min_nodes: int, max_nodes: int, num_nodes: int) -> tuple[int, int]:
    """``(min, max)`` elastic node counts: -1 means 1 for the minimum and ``num_nodes`` for the maximum (as
    DeepSpeed); anything else below 1, or min > max, is a ``ValueError`` naming the flag."""
    low = 1 if min_nodes == -1 else min_nodes
    high = num_nodes if max_nodes == -1 else max_nodes
    for flag, given, value in (("--min_elastic_nodes", min_nodes, low), ("--max_elastic_nodes", max_nodes, high)):
        if value < 1:
            raise ValueError(f"{flag}={given}: the number of elastic nodes must be >= 1 (or -1 for the default)")
    if low > high:
        raise ValueError(f"--min_elastic_nodes={low} is larger than --max_elastic_nodes={high}")
    return low, high


def torchrun_command(*, nproc_per_node: int, min_nodes: int, max_nodes: int, master_addr: str, master_port: int,
                     script: str, script_args: Sequence[str], module: bool = False, no_python: bool = False,
                     run_id: str | None = None) -> list[str]:
    """argv of one node's elastic agent: ``python -u -m torch.distributed.run --nnodes=MIN:MAX ...``.

    Workers get RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* from the agent (no ``--local_rank`` argument, as in
    DeepSpeed's elastic mode)."""
    if module and no_python:
        raise ValueError("--module and --no_python are mutually exclusive")
    run_id = run_id or os.environ.get("ELASTIC_RUN_ID", ELASTIC_TRAINING_ID_DEFAULT)
    cmd = [sys.executable, "-u", "-m", "torch.distributed.run", f"--nnodes={min_nodes}:{max_nodes}",
           f"--nproc_per_node={nproc_per_node}", "--rdzv_backend=c10d", f"--rdzv_endpoint={master_addr}:{master_port}",
           f"--rdzv_id={run_id}", f"--max_restarts={ELASTIC_MAX_RESTARTS}"]
    if module:
        cmd.append("--module")
    if no_python:
        cmd.append("--no_python")
    return cmd + [script] + list(script_args)


def unsupported_flags(args: object) -> list[str]:
    """Launcher options that torch's elastic agent cannot honour (set on ``args``)."""
    bad = []
    if getattr(args, "bind_cores_to_rank", False) or getattr(args, "bind_core_list", None) is not None:
        bad.append("--bind_cores_to_rank/--bind_core_list")
    if getattr(args, "enable_each_rank_log", "None") not in ("None", None):
        bad.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
    if getattr(args, "save_pid", False):
        bad.append("--save_pid")
    return bad


def config_path(user_args: Sequence[str]) -> str | None:
    """The ``--deepspeed_config`` (or deprecated ``--deepscale_config``) path among the script's arguments."""
    for i, arg in enumerate(user_args):
        for flag in _CONFIG_FLAGS:
            if arg == flag and i + 1 < len(user_args):
                return user_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def check_elastic_config(user_args: Sequence[str], min_nodes: int, max_nodes: int, nproc_per_node: int) -> None:
    """With ``--deepspeed_config`` in the script's arguments: its ``elasticity`` section must allow a world size
    of ``n * nproc_per_node`` ranks for some ``n`` in ``min_nodes..max_nodes`` (``compute_elastic_config``'s
    valid GPU counts); else ``ValueError`` naming the flags. No config, or elasticity off: a warning only
    (DeepSpeed's launcher did not read the config; the batch size then does not adapt to the world size)."""
    path = config_path(user_args)
    if path is None or not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as fd:
            ds_config = json.load(fd)
    except (OSError, ValueError) as err:
        raise ValueError(f"--deepspeed_config {path!r} is not readable JSON: {err}") from err
    from ds_config.elastic import compute_elastic_config, elasticity_enabled
    from ds_config.elasticity import ElasticityIncompatibleWorldSize

    if not isinstance(ds_config, dict) or not elasticity_enabled(ds_config):
        logger.warning("--elastic_training: %s has no enabled 'elasticity' section; the batch size will not "
                       "adapt when nodes join or leave", path)
        return
    worlds = [n * nproc_per_node for n in range(min_nodes, max_nodes + 1)]
    try:
        valid = _valid_world_sizes(ds_config, worlds, compute_elastic_config, ElasticityIncompatibleWorldSize)
    except ValueError as err:  # a bad elasticity section (ElasticityConfigError is a ValueError)
        raise ValueError(f"--deepspeed_config {path!r}: {err}") from err
    if not set(worlds) & set(valid):
        raise ValueError(f"--min_elastic_nodes={min_nodes} --max_elastic_nodes={max_nodes} with {nproc_per_node} "
                         f"rank(s) per node give world sizes {worlds}, none of which the 'elasticity' section of "
                         f"{path} accepts (valid GPU counts: {valid})")


def _valid_world_sizes(ds_config: dict, worlds: list[int], compute, incompatible) -> list[int]:
    """``compute_elastic_config``'s valid GPU counts (v0.1: one list; v0.2: per candidate world size)."""
    from deepspeed.__about__ import __version__

    if _is_v01(ds_config):
        return list(compute(ds_config, __version__)[1])
    valid: list[int] = []
    for world in worlds:
        try:
            compute(ds_config, __version__, world_size=world)
        except incompatible as err:
            logger.info("elastic world size %d is not valid: %s", world, err)
            continue
        valid.append(world)
        break
    return valid


def _is_v01(ds_config: dict) -> bool:
    return float(ds_config["elasticity"].get("version", 0.2)) == 0.1

"""The ``deepspeed`` command: launch a training script on one node or many.

Single node (no hostfile, or one host): this process spawns the ranks itself (see :mod:`.launch`). Several
nodes: build a pdsh/mpirun/srun command (see :mod:`.multinode_runner`), or with ``--no_ssh`` run this node's
share directly, started once per node with its ``--node_rank``. With ``--elastic_training`` every node runs
torch's elastic agent (``torch.distributed.run``) over a c10d rendezvous at ``--master_addr:--master_port``
(see :mod:`._elastic`). torch is never imported here.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from deepspeed.launcher import launch
from deepspeed.launcher._elastic import check_elastic_config, resolve_elastic_nodes, unsupported_flags
from deepspeed.launcher._hostfile import (
    HostfileError,
    _parse_hostfile,
    encode_world_info,
    fetch_hostfile,
    parse_inclusion_exclusion,
    parse_resource_filter,
)
from deepspeed.launcher.constants import (
    DEEPSPEED_ENVIRONMENT_NAME,
    DLTS_HOSTFILE,
    LAUNCHERS,
    PDSH_LAUNCHER,
    TORCH_DISTRIBUTED_DEFAULT_PORT,
)
from deepspeed.launcher.multinode_runner import RUNNERS, PDSHRunner
from deepspeed.launcher.resources import exported_environment, local_gpu_count, local_slot_count, read_deepspeed_env

__all__ = ["fetch_hostfile", "parse_inclusion_exclusion", "parse_resource_filter", "encode_world_info",
           "parse_args", "main", "cli", "_parse_hostfile", "run_autotuning"]

logger = logging.getLogger("deepspeed.launcher")


def _add_resource_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-H", "--hostfile", type=str, default=DLTS_HOSTFILE,
                        help="MPI-style hostfile ('worker-0 slots=4' per line) listing the nodes of the job")
    parser.add_argument("-i", "--include", type=str, default="",
                        help="resources to use: NODE_SPEC[@NODE_SPEC ...], NODE_SPEC=NAME[:SLOT[,SLOT ...]]; "
                             "e.g. 'worker-0@worker-1:0,2'")
    parser.add_argument("-e", "--exclude", type=str, default="",
                        help="resources NOT to use, same format as --include")
    parser.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile (-1: all)")
    parser.add_argument("--num_gpus", "--num_accelerators", "--num_procs", dest="num_gpus", type=int, default=-1,
                        help="ranks per node, on slots [0, N) (GPUs; local processes on CPU); -1: all")


def _add_launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master_port", default=TORCH_DISTRIBUTED_DEFAULT_PORT, type=int,
                        help="port on the rank-0 node for torch.distributed's rendezvous")
    parser.add_argument("--master_addr", default="", type=str,
                        help="address of the rank-0 node; inferred with 'hostname -I' over ssh if empty")
    parser.add_argument("--node_rank", default=-1, type=int, help="this node's index, with --no_ssh")
    parser.add_argument("--launcher", default=PDSH_LAUNCHER, type=str.lower, choices=LAUNCHERS,
                        help="multi-node backend")
    parser.add_argument("--launcher_args", default="", type=str, help="extra arguments for the backend command")
    parser.add_argument("--module", action="store_true", help="run the script as a python module (python -m)")
    parser.add_argument("--no_python", action="store_true", help="run the program directly, not through python")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    parser.add_argument("--no_ssh", action="store_true",
                        help="run only this node's ranks (start the launcher on every node with its --node_rank)")
    parser.add_argument("--no_ssh_check", action="store_true", help="skip the passwordless-ssh check (pdsh)")
    parser.add_argument("--ssh_port", type=int, default=None, help="ssh port of the nodes (pdsh)")
    parser.add_argument("--force_multi", action="store_true",
                        help="use the multi-node launcher even when only one node is selected")
    parser.add_argument("--save_pid", action="store_true",
                        help="write the ranks' pids to /tmp/<launcher pid>.deepspeed")
    parser.add_argument("--enable_each_rank_log", default="None", type=str,
                        help="directory where each rank's stdout/stderr is also written")
    parser.add_argument("--bind_cores_to_rank", action="store_true",
                        help="bind each rank to its own share of the cores (CPU training) and set OMP_NUM_THREADS")
    parser.add_argument("--bind_core_list", type=str, default=None,
                        help="cores to share among the ranks, e.g. '1,3-5,7' (default: all cores)")


def _add_elastic_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min_elastic_nodes", type=int, default=-1,
                        help="Minimum number of nodes to run elastic training on. "
                        "Default is 1 when elastic training is enabled")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1,
                        help="Maximum number of nodes to run elastic training on. "
                        "Default is num_nodes when elastic training is enabled")
    parser.add_argument("--elastic_training", action="store_true",
                        help="Enable elastic training support in DeepSpeed.")


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the ``deepspeed`` command line."""
    parser = argparse.ArgumentParser(
        description="DeepSpeed runner: launch distributed multi-node/multi-GPU (or multi-process CPU) training.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_resource_args(parser)
    _add_launch_args(parser)
    _add_elastic_args(parser)
    parser.add_argument("--autotuning", default="", choices=["tune", "run"], type=str,
                        help="run the DeepSpeed Autotuner on the script's --deepspeed_config first: 'tune' writes "
                             "the optimal config and stops, 'run' then launches the job with it; each experiment "
                             "may run DS_AUTOTUNING_EXP_TIMEOUT seconds (environment variable, default 1800) "
                             "before it is killed and recorded as failed")
    parser.add_argument("user_script", type=str, help="the training script (or module, or program)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments for the training script")
    return parser.parse_args(args)


def _resource_pool(args: argparse.Namespace, env: dict[str, str]) -> tuple[dict[str, int], bool]:
    """(host -> slots, whether it came from a hostfile). Without one: the local machine."""
    if args.hostfile != DLTS_HOSTFILE and not os.path.isfile(args.hostfile):
        raise HostfileError(f"--hostfile {args.hostfile!r} does not exist")
    pool = fetch_hostfile(args.hostfile)
    if pool:
        return pool, True
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if visible and local_gpu_count({}) > 0 and all(d.strip().isdigit() for d in visible.split(",")):
        if args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0:
            logger.info("ignoring CUDA_VISIBLE_DEVICES=%s: --include/--exclude/--num_gpus/--num_nodes given",
                        visible)
        else:
            args.include = f"localhost:{visible}"
            logger.info("CUDA_VISIBLE_DEVICES=%s: using --include=%s", visible, args.include)
        del env["CUDA_VISIBLE_DEVICES"]  # the per-node launcher sets it from the selected slots
        return {"localhost": local_gpu_count({})}, False
    return {"localhost": local_slot_count(env)}, False


def select_resources(args: argparse.Namespace, env: dict[str, str]) -> tuple[dict[str, list[int]], bool]:
    """Active resources ``{host: [slot, ...]}`` after hostfile, include/exclude, --num_nodes and --num_gpus."""
    active, from_hostfile, _ = select_resources_and_pool(args, env)
    return active, from_hostfile


def select_resources_and_pool(args: argparse.Namespace,
                              env: dict[str, str]) -> tuple[dict[str, list[int]], bool, dict[str, int]]:
    """:func:`select_resources` plus the resource pool ``{host: slots}`` it started from (DeepSpeed's
    ``resource_pool``, which the MPI and Slurm runners take)."""
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise ValueError("--num_nodes/--num_gpus cannot be combined with --include/--exclude "
                         f"(got --include={args.include!r} --exclude={args.exclude!r})")
    if args.num_nodes == 0 or args.num_nodes < -1 or args.num_gpus == 0 or args.num_gpus < -1:
        raise ValueError(f"--num_nodes={args.num_nodes} --num_gpus={args.num_gpus}: use a positive count or -1")
    pool, from_hostfile = _resource_pool(args, env)
    if not from_hostfile and args.num_nodes > 1:
        raise ValueError(f"--num_nodes={args.num_nodes} but no hostfile lists other nodes "
                         f"(--hostfile {args.hostfile!r} not found)")
    active = parse_inclusion_exclusion(pool, args.include, args.exclude)
    if args.num_nodes > 0:
        if args.num_nodes > len(active):
            raise ValueError(f"--num_nodes={args.num_nodes} but only {len(active)} node(s) are available: "
                             f"{', '.join(active)}")
        active = collections.OrderedDict(list(active.items())[: args.num_nodes])
    if args.num_gpus > 0:
        active = collections.OrderedDict((host, list(range(args.num_gpus))) for host in active)
    if not active:
        raise ValueError(f"no resources left after --include={args.include!r} --exclude={args.exclude!r}")
    return active, from_hostfile, dict(pool)


def _master_addr(args: argparse.Namespace, active: dict[str, list[int]], multi_node: bool) -> str:
    if args.master_addr:
        return args.master_addr
    if not multi_node:
        return "127.0.0.1"
    first_host = next(iter(active))
    if args.no_ssh:
        raise ValueError("--no_ssh with several nodes needs --master_addr (the address of node 0)")
    if args.launcher != PDSH_LAUNCHER:
        return first_host  # MPI/Slurm nodes resolve each other's names
    ssh = ["ssh"] + (["-p", str(args.ssh_port)] if args.ssh_port else []) + [first_host, "hostname", "-I"]
    try:
        out = subprocess.check_output(ssh, text=True, timeout=60)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        raise RuntimeError(f"could not get the address of {first_host} with {' '.join(ssh)!r} ({err}); "
                           "pass --master_addr") from err
    if not out.split():
        raise RuntimeError(f"'hostname -I' on {first_host} printed nothing; pass --master_addr")
    logger.info("Using IP address of %s for node %s", out.split()[0], first_host)
    return out.split()[0]


def _ssh_check(args: argparse.Namespace, first_host: str) -> None:
    ssh = ["ssh", "-o", "PasswordAuthentication=no"] + (["-p", str(args.ssh_port)] if args.ssh_port else [])
    try:
        subprocess.check_call(ssh + [first_host, "hostname"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=60)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        raise RuntimeError(f"Using hostfile at {args.hostfile} but host={first_host} was not reachable via ssh. "
                           f"If you are running with a single node please remove {args.hostfile} or set up "
                           "passwordless ssh (or use --no_ssh).") from err


def local_launch_args(args: argparse.Namespace, world_info: str, node_rank: int) -> list[str]:
    """Arguments of :func:`deepspeed.launcher.launch.main` for this node."""
    out = [f"--world_info={world_info}", f"--node_rank={node_rank}", f"--master_addr={args.master_addr}",
           f"--master_port={args.master_port}"]
    out += [flag for flag in ("--no_python", "--module", "--no_local_rank") if getattr(args, flag[2:])]
    if args.save_pid:
        out.append(f"--save_pid={os.getpid()}")
    if args.enable_each_rank_log != "None":
        out.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
    if args.bind_cores_to_rank:
        out.append("--bind_cores_to_rank")
    if args.bind_core_list is not None:
        out.append(f"--bind_core_list={args.bind_core_list}")
    return out + elastic_launch_args(args) + [args.user_script] + list(args.user_args)


def elastic_launch_args(args: argparse.Namespace) -> list[str]:
    """The per-node launcher's elastic flags, in DeepSpeed's order (none unless ``--elastic_training``)."""
    if not getattr(args, "elastic_training", False):
        return []
    return ["--enable_elastic_training", f"--max_elastic_nodes={args.max_elastic_nodes}",
            f"--min_elastic_nodes={args.min_elastic_nodes}"]


def validate_elastic(args: argparse.Namespace, active: dict[str, list[int]], multi_node: bool) -> None:
    """Check the elastic flags against each other, the launch mode and the script's ``--deepspeed_config``."""
    if not args.elastic_training:
        for flag in ("min_elastic_nodes", "max_elastic_nodes"):
            if getattr(args, flag) != -1:
                raise ValueError(f"--{flag}={getattr(args, flag)} needs --elastic_training")
        return
    low, high = resolve_elastic_nodes(args.min_elastic_nodes, args.max_elastic_nodes, len(active))
    if high < len(active):
        raise ValueError(f"--max_elastic_nodes={high} but {len(active)} nodes are selected "
                         f"({', '.join(active)}); lower --num_nodes or raise --max_elastic_nodes")
    if multi_node and not args.no_ssh and args.launcher != PDSH_LAUNCHER:
        raise ValueError(f"--elastic_training runs torch's elastic agent on every node, which the "
                         f"'{args.launcher}' launcher cannot start; use --launcher=pdsh or --no_ssh")
    if unsupported_flags(args):
        raise ValueError(f"{', '.join(unsupported_flags(args))}: not supported with --elastic_training")
    if low > len(active):
        logger.warning("--min_elastic_nodes=%d: waiting for %d more node(s) to join the rendezvous",
                       low, low - len(active))
    slots = {len(s) for s in active.values()}
    if len(slots) == 1:
        check_elastic_config(args.user_args, low, high, slots.pop())


def _run_local(args: argparse.Namespace, active: dict[str, list[int]], env: dict[str, str]) -> int:
    node_rank = args.node_rank
    if len(active) > 1 and not 0 <= node_rank < len(active):
        raise ValueError(f"--no_ssh with {len(active)} nodes ({', '.join(active)}) needs --node_rank in "
                         f"0..{len(active) - 1}, got {node_rank}")
    node_rank = max(node_rank, 0)
    return launch.main(local_launch_args(args, encode_world_info(active), node_rank), env)


def _run_multinode(args: argparse.Namespace, active: dict[str, list[int]], pool: dict[str, int],
                   env: dict[str, str], ds_env: dict[str, str]) -> int:
    world_info = encode_world_info(active)
    if args.launcher == PDSH_LAUNCHER:
        runner = PDSHRunner(args, world_info)
    else:
        runner = RUNNERS[args.launcher](args, world_info, pool)
    if not runner.backend_exists():
        raise RuntimeError(f"launcher '{args.launcher}' not installed ('{runner.executable}' is not on PATH)")
    cwd = os.path.abspath(".")
    env["PYTHONPATH"] = f"{cwd}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else cwd
    for key, val in {**exported_environment(env), **ds_env}.items():
        runner.add_export(key, val)
    kill_cmd = None
    if isinstance(runner, PDSHRunner):
        cmd, kill_cmd, env = runner.get_cmd(env, active)
    else:
        cmd = runner.get_cmd(env, active)
    logger.info("cmd = %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)
        if kill_cmd is not None:
            subprocess.run(kill_cmd, env=env, check=False)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    code = proc.wait()
    return code if code >= 0 else 128 - code


def run(args: argparse.Namespace) -> int:
    """Launch the job described by parsed ``args``; returns the exit code."""
    env = dict(os.environ)
    active, from_hostfile, pool = select_resources_and_pool(args, env)
    multi_node = args.force_multi or len(active) > 1
    ds_env = read_deepspeed_env([os.path.expanduser("~"), "."], DEEPSPEED_ENVIRONMENT_NAME)
    validate_elastic(args, active, multi_node)
    if multi_node and not args.no_ssh and args.launcher == PDSH_LAUNCHER and not args.no_ssh_check:
        _ssh_check(args, next(iter(active)))
    args.master_addr = _master_addr(args, active, multi_node)
    logger.info("Active resources: %s, master %s:%s", dict(active), args.master_addr, args.master_port)
    if getattr(args, "autotuning", ""):
        return run_autotuning(args, active, from_hostfile)
    if not multi_node or args.no_ssh:
        env.update(ds_env)
        return _run_local(args, active, env)
    return _run_multinode(args, active, pool, env, ds_env)


def run_autotuning(args: argparse.Namespace, active_resources: dict[str, list[int]],
                   from_hostfile: bool = False) -> int:
    """``--autotuning tune|run``: search with :class:`deepspeed.autotuning.Autotuner`, write the results and
    ``ds_config_optimal.json``; with ``run`` then launch the job with it. Returns the exit code (1 when no
    experiment succeeded)."""
    from deepspeed.autotuning import Autotuner

    tuner = Autotuner(args, active_resources, from_hostfile=from_hostfile)
    logger.info("[Start] Running autotuning")
    tuner.tune()
    tuner.print_tuning_results()
    logger.info("[End] Running autotuning")
    if tuner.write_optimal_config() is None:
        logger.error("autotuning found no configuration that runs; see %s", tuner.results_dir)
        return 1
    if args.autotuning == "run":
        return tuner.run_after_tuning()
    return 0


def _log_to_stderr() -> None:
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[launcher] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def cli(args: Sequence[str] | None = None) -> None:
    """The ``deepspeed`` command: a user error (bad resource arguments, missing backend) prints one line
    ``deepspeed: error: ...`` and exits 2; otherwise exits with the job's exit code."""
    _log_to_stderr()
    parsed = parse_args(args)
    try:
        code = run(parsed)
    except (ValueError, RuntimeError) as err:  # user errors: one clear line, no traceback
        sys.stderr.write(f"deepspeed: error: {err}\n")
        sys.exit(2)
    sys.exit(code)


def main(args: Sequence[str] | None = None) -> None:
    """DeepSpeed's ``runner.main``: launch the job; a failing job exits with its exit code.

    Called with ``args`` (a list, as programs and DeepSpeed's tests do), bad resource arguments raise
    ``ValueError`` as DeepSpeed's does (a missing backend ``RuntimeError``). Without ``args`` it is the
    console script and behaves as :func:`cli` (one error line, exit code 2).
    """
    if args is None:
        cli()
    _log_to_stderr()
    code = run(parse_args(args))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    cli()

"""``deepspeed.comm``: ``init_distributed`` from launcher / OpenMPI / SLURM environments, every wrapped
collective against its analytic result on real gloo ranks, the comms logger and ``log_summary``, timeouts."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _harness import DistributedTestFailure, run_distributed
from hypothesis import given
from hypothesis import strategies as st

import deepspeed.comm as ds_comm
from deepspeed.comm._env import discover_launch_env, expand_hostlist
from deepspeed.utils import log_dist, logger
from deepspeed.utils.comms_logging import calc_bw_log, convert_size
from ds_config import CommsLoggerConfig, ConfigError


def _placement():
    return (ds_comm.get_rank(), ds_comm.get_world_size(), ds_comm.get_local_rank(), ds_comm.get_backend(),
            os.environ["MASTER_ADDR"])


# -- init_distributed -----------------------------------------------------------------------------------------
def _init_from_launcher_env():
    assert not ds_comm.is_initialized()
    ds_comm.init_distributed(verbose=False)
    first = dist.group.WORLD
    ds_comm.init_distributed(verbose=False)  # idempotent: keeps the existing group
    assert dist.group.WORLD is first
    return _placement()


def test_init_from_launcher_env():
    out = run_distributed(_init_from_launcher_env, 2, init_process_group=False, timeout=30)
    assert out == [(0, 2, 0, "gloo", "127.0.0.1"), (1, 2, 1, "gloo", "127.0.0.1")]


def _init_from_scheduler(kind: str):
    rank, world, port = os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        del os.environ[name]
    if kind == "openmpi":  # one node: every rank is local, so the master is loopback
        os.environ.update(OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_SIZE=world, OMPI_COMM_WORLD_LOCAL_RANK=rank,
                          OMPI_COMM_WORLD_LOCAL_SIZE=world)
    else:  # the master is the first host of the node list
        os.environ.update(SLURM_PROCID=rank, SLURM_NTASKS=world, SLURM_LOCALID=rank, SLURM_NODELIST="127.0.0.[1-4]")
    ds_comm.init_distributed(distributed_port=int(port), verbose=False)
    return (*_placement(), os.environ["RANK"], os.environ["MASTER_PORT"] == port)


@pytest.mark.parametrize("kind", ["openmpi", "slurm"])
def test_init_from_scheduler_env(kind):
    out = run_distributed(_init_from_scheduler, 2, args=(kind,), init_process_group=False, timeout=30)
    assert out == [(r, 2, r, "gloo", "127.0.0.1", str(r), True) for r in range(2)]


def _init_explicit():
    rank = int(os.environ.pop("RANK"))
    os.environ.pop("WORLD_SIZE")
    url = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    ds_comm.init_distributed("gloo", init_method=url, rank=rank, world_size=2, verbose=False,
                             timeout=timedelta(seconds=20), config={"comms_logger": {"enabled": True}})
    enabled = ds_comm.comms_logger.enabled
    ds_comm.configure(CommsLoggerConfig())
    return ds_comm.get_rank(), enabled


def test_init_with_explicit_rank_and_config():
    assert run_distributed(_init_explicit, 2, init_process_group=False, timeout=30) == [(0, True), (1, True)]


def test_discovery_rules():
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODELIST": "gpu[007-010],x"}
    found = discover_launch_env(29500, environ=slurm)
    assert (found.rank, found.world_size, found.local_rank, found.master_addr, found.master_port) == (
        5, 8, 1, "gpu007", 29500)
    assert discover_launch_env(1234, environ={**slurm, "MASTER_ADDR": "h0"}).master_addr == "h0"
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="MASTER_ADDR is unset"):
            discover_launch_env(29500, environ=ompi)  # several nodes, no way to learn rank 0's host
    assert discover_launch_env(29500, environ={**ompi, "MASTER_ADDR": "n0"}).source == "openmpi"
    assert discover_launch_env(29500, auto_mpi_discovery=False, environ=ompi).source == "single-process"
    assert discover_launch_env(7, environ={}).master_port == 7
    launcher = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "99", **slurm}
    assert discover_launch_env(1, environ=launcher).source == "env"  # launcher variables win
    with pytest.raises(ValueError, match="WORLD_SIZE is unset"):
        discover_launch_env(1, environ={"RANK": "0"})
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        discover_launch_env(1, environ={"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a"})
    with pytest.raises(ValueError, match="pass both rank and world_size"):
        ds_comm.init_distributed(rank=0, dist_init_required=True, verbose=False)
    with pytest.raises(ConfigError, match="comms_logger"):
        ds_comm.configure({"comms_logger": {"enable": True}})
    if not dist.is_initialized():  # as DeepSpeed: the caller said it owns a group that does not exist
        with pytest.raises(RuntimeError, match="dist_init_required=False.*not initialized"):
            ds_comm.init_distributed(dist_init_required=False, verbose=False)


@given(prefix=st.text("abcxyz-", min_size=1, max_size=5), lo=st.integers(0, 50), span=st.integers(0, 20),
       width=st.integers(1, 4))
def test_expand_hostlist_ranges(prefix, lo, span, width):
    hi = lo + span
    hosts = expand_hostlist(f"{prefix}[{str(lo).zfill(width)}-{str(hi).zfill(width)}],login")
    assert len(hosts) == span + 2 and hosts[-1] == "login"
    assert hosts[0] == prefix + str(lo).zfill(width) and hosts[-2] == prefix + str(hi).zfill(width)


def test_expand_hostlist_errors():
    assert expand_hostlist("r[1-2]-n[8,10]") == ["r1-n8", "r1-n10", "r2-n8", "r2-n10"]
    for bad in ("", "node[1-2", "node[a-b]", "a,,b", "n]1", "n[[1]]"):
        with pytest.raises(ValueError, match="SLURM host list"):
            expand_hostlist(bad)


# -- collectives ----------------------------------------------------------------------------------------------
def _collectives_two_ranks():
    r, n = ds_comm.get_rank(), ds_comm.get_world_size()
    out = {}
    t = torch.tensor([r + 1.0, 10.0 * r])
    ds_comm.all_reduce(t)
    out["all_reduce"] = t.tolist()
    t = torch.tensor([float(r)])
    ds_comm.all_reduce(t, op=ds_comm.ReduceOp.MAX, async_op=True).wait()
    out["all_reduce_max_async"] = t.item()
    t = torch.tensor([r + 1.0])
    ds_comm.reduce(t, dst=1)
    out["reduce"] = t.item() if r == 1 else None
    t = torch.tensor([7.0 if r == 1 else 0.0])
    ds_comm.broadcast(t, src=1)
    out["broadcast"] = t.item()
    parts = [torch.zeros(2) for _ in range(n)]
    ds_comm.all_gather(parts, torch.full((2,), float(r)))
    out["all_gather"] = [p.tolist() for p in parts]
    flat = torch.zeros(2 * n)
    ds_comm.all_gather_into_tensor(flat, torch.tensor([r, r + 0.5]))
    out["all_gather_into_tensor"] = flat.tolist()
    shard = torch.zeros(2)
    ds_comm.reduce_scatter_tensor(shard, torch.arange(4.0) + 10 * r)
    out["reduce_scatter_tensor"] = shard.tolist()
    a2a = torch.zeros(2)
    ds_comm.all_to_all_single(a2a, torch.tensor([10.0 * r, 10.0 * r + 1]))
    out["all_to_all_single"] = a2a.tolist()
    if r == 0:
        ds_comm.send(torch.tensor([42.0]), dst=1)
        got = torch.zeros(1)
        ds_comm.irecv(got, src=1).wait()
    else:
        got = torch.zeros(1)
        ds_comm.recv(got, src=0)
        ds_comm.isend(got + 1, dst=0).wait()
    out["p2p"] = got.item()
    group = ds_comm.new_group([1])
    out["global_rank"] = ds_comm.get_global_rank(group, 0) if r == 1 else None
    out["ranks"] = ds_comm.get_all_ranks_from_group()
    ds_comm.barrier()
    return out


def test_collectives_two_ranks():
    out = run_distributed(_collectives_two_ranks, 2, timeout=30)
    for r, res in enumerate(out):
        assert res["all_reduce"] == [3.0, 10.0] and res["all_reduce_max_async"] == 1.0
        assert res["broadcast"] == 7.0
        assert res["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert res["all_gather_into_tensor"] == [0.0, 0.5, 1.0, 1.5]
        # input on rank k: [0,1,2,3] + 10k; the sum is [10,12,14,16]; rank r keeps elements 2r, 2r+1
        assert res["reduce_scatter_tensor"] == [[10.0, 12.0], [14.0, 16.0]][r]
        # rank k sends element j to rank j: rank r receives [10*0 + r, 10*1 + r]
        assert res["all_to_all_single"] == [0.0 + r, 10.0 + r]
        assert res["p2p"] == (43.0 if r == 0 else 42.0)
        assert res["ranks"] == [0, 1]
    assert out[1]["reduce"] == 3.0 and out[1]["global_rank"] == 1


def _collectives_four_ranks():
    r = ds_comm.get_rank()
    odd = ds_comm.new_group([1, 3])
    even = ds_comm.new_group([0, 2])
    mine = odd if r % 2 else even
    t = torch.tensor([float(r)])
    ds_comm.all_reduce(t, group=mine)
    # uneven all-to-all: rank r sends r+1 copies... to each peer k it sends k+1 values
    send = torch.cat([torch.full((k + 1,), float(10 * r + k)) for k in range(4)])
    recv = torch.zeros(4 * (r + 1))
    ds_comm.all_to_all_single(recv, send, output_split_sizes=[r + 1] * 4, input_split_sizes=[1, 2, 3, 4])
    return t.item(), ds_comm.get_world_size(mine), ds_comm.get_global_rank(mine, 1), recv.tolist()


def test_groups_and_uneven_all_to_all_four_ranks():
    out = run_distributed(_collectives_four_ranks, 4, timeout=40)
    for r, (group_sum, size, second, received) in enumerate(out):
        assert group_sum == (4.0 if r % 2 else 2.0) and size == 2 and second == (3 if r % 2 else 2)
        assert received == [float(10 * k + r) for k in range(4) for _ in range(r + 1)]


# -- comms logger ---------------------------------------------------------------------------------------------
def _logged_ops():
    ds_comm.comms_logger.reset()
    ds_comm.configure(CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=["all_reduce"]))
    for _ in range(3):
        ds_comm.all_reduce(torch.ones(256))  # 1 KiB
    ds_comm.all_reduce(torch.ones(1024, dtype=torch.float64))  # 8 KiB
    ds_comm.broadcast(torch.ones(4), src=0)  # not selected
    ds_comm.broadcast(torch.ones(4), src=0, prof=True, log_name="my_bcast")  # selected at the call
    ds_comm.configure(prof_all=True, debug=True)
    ds_comm.all_gather_into_tensor(torch.zeros(32), torch.ones(16))
    records = {op: {size: rec.count for size, rec in sizes.items()}
               for op, sizes in ds_comm.comms_logger.comms_dict.items()}
    latencies = [lat for sizes in ds_comm.comms_logger.comms_dict.values() for rec in sizes.values()
                 for lat in rec.latencies_ms]
    table = ds_comm.log_summary(show_straggler=True)
    ds_comm.configure(CommsLoggerConfig())
    ds_comm.comms_logger.reset()
    return records, min(latencies) > 0, table


def test_comms_logger_counts_sizes_and_summary(capfd):
    out = run_distributed(_logged_ops, 2, timeout=30)
    records, positive, table = out[0]
    assert records == {
        "all_reduce": {1024: 3, 8192: 1},
        "my_bcast": {16: 1},
        "all_gather_into_tensor | [Caller Func: _logged_ops]": {64: 1},
    }
    assert positive and out[1][0] == records
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["Comm.", "Op", "Message", "Size"] and "busbw_avg (Gbps)" in lines[0]
    assert "Straggler(ms)" in lines[0]
    at = lines.index("all_reduce")
    assert lines[at + 1].split()[:3] == ["1.0", "KB", "3"] and lines[at + 2].split()[:3] == ["8.0", "KB", "1"]
    assert lines[lines.index("my_bcast") + 1].split()[:3] == ["16.0", "B", "1"]
    printed = capfd.readouterr().out
    assert printed.count("Total Latency(ms)") == 1  # printed on rank 0 only


def _profiled_point_to_point():
    """Profiled point-to-point ops are not waited on for their timing: both ranks send first here, so a
    send that waited for its receive would deadlock (and a gloo point-to-point work waited twice blocks)."""
    ds_comm.comms_logger.reset()
    ds_comm.configure(CommsLoggerConfig(enabled=True, prof_all=True))
    try:
        peer = 1 - ds_comm.get_rank()
        got = torch.zeros(8)
        sent = ds_comm.isend(torch.full((8,), float(ds_comm.get_rank())), dst=peer)
        ds_comm.irecv(got, src=peer).wait()
        sent.wait()
        mine, theirs = torch.full((4,), 10.0 + ds_comm.get_rank()), torch.zeros(4)
        works = ds_comm.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
        for work in works:
            work.wait()
        ds_comm.all_reduce(torch.ones(2), async_op=True).wait()
        records = {op: {size: rec.count for size, rec in sizes.items()}
                   for op, sizes in ds_comm.comms_logger.comms_dict.items()}
    finally:
        ds_comm.configure(CommsLoggerConfig())
        ds_comm.comms_logger.reset()
    return got[0].item(), theirs[0].item(), records


def test_profiled_async_ops_can_still_be_waited():
    for rank, (got, theirs, records) in enumerate(run_distributed(_profiled_point_to_point, 2, timeout=30)):
        assert (got, theirs) == (1.0 - rank, 11.0 - rank)
        assert records == {"isend": {32: 1}, "irecv": {32: 1}, "batch_isend_irecv": {16: 1}, "all_reduce": {8: 1}}


def test_bandwidth_formulas():
    # 1 MB in 1 ms on 4 ranks: all-reduce moves 2x (alg 16 Gbps) and busbw 2(n-1)/n (12 Gbps)
    assert calc_bw_log("all_reduce", 10**6, 1.0, 4) == pytest.approx((16.0, 12.0))
    assert calc_bw_log("all_gather_into_tensor", 10**6, 1.0, 4) == pytest.approx((32.0, 24.0))
    assert calc_bw_log("all_to_all_single", 10**6, 2.0, 4) == pytest.approx((4.0, 3.0))
    assert calc_bw_log("broadcast", 10**6, 1.0, 4) == pytest.approx((8.0, 8.0))
    with pytest.raises(ValueError, match="unknown comm_op 'allreduce'"):
        calc_bw_log("allreduce", 1, 1.0, 2)
    assert (convert_size(0), convert_size(1536), convert_size(3 * 2**20)) == ("0B", "1.5 KB", "3.0 MB")


# -- timeouts and logging -------------------------------------------------------------------------------------
def _timeout_names_the_rank():
    ds_comm.init_distributed(verbose=False, timeout=timedelta(seconds=1))
    result = None
    if ds_comm.get_rank() == 0:
        start = time.monotonic()
        try:
            ds_comm.all_reduce(torch.ones(1))
        except RuntimeError as exc:
            result = (time.monotonic() - start, " ".join(getattr(exc, "__notes__", [])))
    else:
        time.sleep(6)  # never joins: rank 0 must give up after the group's 1 s, not wait for us
    dist.destroy_process_group()
    return result


def test_collective_times_out_and_names_rank():
    elapsed, note = run_distributed(_timeout_names_the_rank, 2, init_process_group=False, timeout=30)[0]
    assert 0.7 < elapsed < 5
    assert "deepspeed.comm.all_reduce failed on rank 0" in note and "call #" in note


def _log_dist_ranks():
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    try:
        log_dist("only zero", ranks=[0])
        log_dist("everyone", ranks=[-1])
        log_dist("nobody")
    finally:
        logger.removeHandler(handler)
    return records


def test_log_dist_selects_ranks():
    out = run_distributed(_log_dist_ranks, 2, timeout=30)
    assert out == [["[Rank 0] only zero", "[Rank 0] everyone"], ["[Rank 1] everyone"]]
    assert logger.name == "DeepSpeed" and not logger.propagate


def _init_single_process(backend: str | None):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        del os.environ[name]
    ds_comm.configure(CommsLoggerConfig(enabled=True))
    ds_comm.comms_logger.reset()
    ds_comm.init_distributed(dist_backend=backend, distributed_port=int(os.environ["MASTER_PORT"]), verbose=False)
    device = "cuda" if ds_comm.get_backend() == "nccl" else "cpu"
    t = torch.ones(4, device=device)
    ds_comm.all_reduce(t)
    counts = {op: sum(r.count for r in sizes.values()) for op, sizes in ds_comm.comms_logger.comms_dict.items()}
    ds_comm.configure(CommsLoggerConfig())
    return _placement(), t.sum().item(), counts


def test_plain_python_run_is_one_rank():
    placement, total, counts = run_distributed(_init_single_process, 1, args=(None,), init_process_group=False,
                                               timeout=30)[0]
    assert placement == (0, 1, 0, "gloo", "127.0.0.1") and total == 4.0 and counts == {"all_reduce": 1}


@pytest.mark.gpu
def test_nccl_on_cuda():
    placement, total, counts = run_distributed(_init_single_process, 1, args=("nccl",), init_process_group=False,
                                               timeout=60)[0]
    assert placement[3] == "nccl" and total == 4.0 and counts == {"all_reduce": 1}


def _peer_dies():
    ds_comm.init_distributed(verbose=False, timeout=timedelta(seconds=20))
    ds_comm.barrier()
    if ds_comm.get_rank() == 1:
        os._exit(3)  # a crashed rank: its sockets close
    ds_comm.all_reduce(torch.ones(1))


def test_dead_peer_fails_fast_not_after_the_timeout():
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(_peer_dies, 2, init_process_group=False, timeout=30)
    survivor = failure.value.ranks[0]
    assert survivor.status == "raised", survivor  # rank 0 errored within the harness's 1 s grace, well before 20 s
    assert "deepspeed.comm.all_reduce failed on rank 0" in survivor.detail


def test_logger_helpers(tmp_path, monkeypatch):
    from deepspeed.utils import logging as ds_logging

    path = tmp_path / "out.json"
    ds_logging.print_json_dist({"loss": 1.5}, ranks=[0], path=str(path))  # no group yet: every process writes
    assert path.read_text().strip() == '{"loss": 1.5, "rank": -1}'
    monkeypatch.setattr(logger, "level", logging.INFO)
    assert ds_logging.should_log_le("info") and not ds_logging.should_log_le("debug")
    with pytest.raises(ValueError, match="'loud' is not a log level"):
        ds_logging.should_log_le("loud")
    formatter = logger.handlers[0].formatter
    record = logging.LogRecord("DeepSpeed", logging.INFO, "/x/engine.py", 12, "hello", None, None, func="step")
    assert formatter.format(record).endswith("] [INFO] [engine.py:12:step] hello")


_GROUP_LIFETIME = r'''
import gc, os, socket, sys
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
import torch
import torch.distributed as dist

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
dist.init_process_group("gloo")  # made before deepspeed is imported, as Accelerate's PartialState does
torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)  # torch imports torch.distributed.nn here
if sys.argv[1] == "deepspeed":
    import deepspeed.comm  # noqa: F401
during = threads()
dist.destroy_process_group()
gc.collect()
print(before, during, threads())
'''


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")
def test_destroyed_group_releases_its_threads():
    """torch.distributed.nn's default arguments pin the group that existed when torch imported it; its gloo
    threads then outlive destroy_process_group, and one freeing a tensor at interpreter exit aborted ranks
    ("terminate called without an active exception"). Importing deepspeed.comm unpins it."""
    import subprocess
    import sys

    def run(mode):
        out = subprocess.run([sys.executable, "-c", _GROUP_LIFETIME, mode], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return [int(v) for v in out.stdout.split()]

    before, during, after = run("torch")
    assert during > before and after == during  # the torch-only process shows the leak this guards against
    before, during, after = run("deepspeed")
    assert during > before and after == before


_EXIT_WITHOUT_DESTROY = r'''
import atexit, os, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch.distributed as dist

atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))  # runs after later handlers
import deepspeed.comm  # registers its exit hook, which runs before the handler above

deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)
deepspeed.comm.barrier()
print("trained")
'''


def test_a_group_made_by_init_distributed_is_destroyed_at_exit():
    """Scripts (and the Trainer) rarely destroy their group; a gloo thread still running while the interpreter
    finalises can abort the process, so deepspeed.comm destroys the groups in an exit handler (registered when
    it is imported, so handlers registered later still find the group)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_DESTROY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-3:] == ["trained", "initialized at exit: False", ""], out.stdout

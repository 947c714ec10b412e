"""Real launches: ranks' env and rank-prefixed output, gloo all-reduce, failure, signals, two-node rendezvous."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.path.exists("/job/hostfile"), reason="a real /job/hostfile would be used")

_CONSOLE = Path(sys.executable).with_name("deepspeed")
LAUNCHER = [str(_CONSOLE)] if _CONSOLE.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]

ALLREDUCE = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank={dist.get_rank()} world={dist.get_world_size()} local={os.environ['LOCAL_RANK']} "
          f"lws={os.environ['LOCAL_WORLD_SIZE']} node={os.environ['CROSS_RANK']} sum={t.item():g} "
          f"foo={os.environ.get('FOO')} args={sys.argv[1:]}")
    dist.destroy_process_group()
""")

# Rank 0 records its pid and waits; rank 1 fails once rank 0 is up.
FAILING = textwrap.dedent("""
    import os, sys, time
    rank = int(os.environ["RANK"])
    if rank == 0:
        open(f"pid{rank}.tmp", "w").write(str(os.getpid()))
        os.rename(f"pid{rank}.tmp", f"pid{rank}")
        time.sleep(120)
    while not os.path.exists("pid0"):
        time.sleep(0.02)
    print("rank 1 gives up", file=sys.stderr)
    sys.exit(7)
""")

# Both ranks record their pid, then wait; SIGTERM makes them write a marker and exit 0.
WAITING = textwrap.dedent("""
    import os, signal, sys, time
    rank = os.environ["RANK"]
    def on_term(signum, frame):
        open(f"term{rank}", "w").write(str(signum))
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    open(f"pid{rank}.tmp", "w").write(str(os.getpid()))
    os.rename(f"pid{rank}.tmp", f"pid{rank}")
    time.sleep(120)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _launch(tmp_path: Path, script: str, *flags: str, env=None, **kw) -> subprocess.Popen:
    (tmp_path / "script.py").write_text(script)
    return subprocess.Popen(LAUNCHER + [*flags, "script.py"], cwd=tmp_path, env=env or _env(tmp_path), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"ranks did not start: rc={proc.poll()} {proc.communicate(timeout=10)}")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie awaiting its parent counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _gone_soon(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.timeout(120)
def test_two_local_ranks_all_reduce_with_rank_prefixed_output(tmp_path):
    Path(tmp_path / ".deepspeed_env").write_text("FOO=from_env_file\n")
    port = _free_port()
    proc = _launch(tmp_path, ALLREDUCE, "--num_procs=2", f"--master_port={port}")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err
    lines = sorted(line for line in out.splitlines() if "sum=" in line)
    assert lines == [
        f"[rank{r}]: rank={r} world=2 local={r} lws=2 node=0 sum=3 foo=from_env_file args=['--local_rank={r}']"
        for r in (0, 1)
    ]
    assert f"master 127.0.0.1:{port}" in err


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_others_and_sets_exit_code(tmp_path):
    proc = _launch(tmp_path, FAILING, "--num_gpus=2")
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 7
    assert "[rank1]: rank 1 gives up" in err
    assert "rank 1" in err and "failed with exit code 7; stopping the other ranks" in err
    assert _gone_soon(int((tmp_path / "pid0").read_text()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded_to_every_rank(tmp_path, signum):
    proc = _launch(tmp_path, WAITING, "--num_procs=2", "--no_local_rank")
    pids = [tmp_path / "pid0", tmp_path / "pid1"]
    _wait_for(pids, proc)
    proc.send_signal(signum)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum
    if signum == signal.SIGTERM:  # SIGTERM reaches the ranks' handlers
        assert [(tmp_path / f"term{r}").read_text() for r in (0, 1)] == [str(int(signum))] * 2
    assert all(_gone_soon(int(p.read_text())) for p in pids)


@pytest.mark.timeout(60)
def test_killed_launcher_leaves_no_orphans(tmp_path):
    proc = _launch(tmp_path, WAITING, "--num_procs=2")
    pids = [tmp_path / "pid0", tmp_path / "pid1"]
    _wait_for(pids, proc)
    proc.kill()
    proc.communicate(timeout=30)
    assert all(_gone_soon(int(p.read_text())) for p in pids)


@pytest.mark.timeout(60)
def test_no_python_and_module_modes(tmp_path):
    tool = tmp_path / "tool.sh"
    tool.write_text('#!/bin/sh\necho "shell rank $RANK of $WORLD_SIZE: $*"\n')
    tool.chmod(0o755)
    (tmp_path / "mymod.py").write_text("import os, sys\nprint('module', os.environ['RANK'], sys.argv[1:])\n")
    env = _env(tmp_path)
    shell = subprocess.run(LAUNCHER + ["--num_procs=2", "--no_python", "--no_local_rank",
                                       str(tool), "x"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=50)
    assert shell.returncode == 0, shell.stderr
    assert sorted(shell.stdout.splitlines()) == ["[rank0]: shell rank 0 of 2: x", "[rank1]: shell rank 1 of 2: x"]
    env["PYTHONPATH"] = str(tmp_path)
    mod = subprocess.run(LAUNCHER + ["--num_procs=1", "--module", "mymod", "y"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=50)
    assert mod.stdout == "[rank0]: module 0 ['--local_rank=0', 'y']\n", mod.stderr


def test_missing_program_is_a_clear_error(tmp_path):
    out = subprocess.run(LAUNCHER + ["--num_procs=1", "--no_python", str(tmp_path / "nope")], capture_output=True,
                         text=True, timeout=50, env=_env(tmp_path))
    assert out.returncode == 2
    assert f"deepspeed: error: cannot start rank 0: '{tmp_path / 'nope'}': No such file or directory" in out.stderr


def test_bad_hostfile_is_reported_with_its_line(tmp_path):
    (tmp_path / "hosts").write_text("node0 slots=1\nnode1 slot=1\n")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={tmp_path / 'hosts'}", "t.py"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=50, env=_env(tmp_path))
    assert out.returncode == 2
    assert "deepspeed: error:" in out.stderr and "'node1 slot=1'" in out.stderr and "hosts:2" in out.stderr


@pytest.mark.timeout(120)
def test_two_node_rendezvous_with_no_ssh(tmp_path):
    """Two launchers (node_rank 0 and 1, --no_ssh) against 127.0.0.1 form one 2-rank gloo job."""
    (tmp_path / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    port = _free_port()
    flags = [f"--hostfile={tmp_path / 'hostfile'}", "--no_ssh", "--master_addr=127.0.0.1", f"--master_port={port}"]
    nodes = [_launch(tmp_path, ALLREDUCE, *flags, f"--node_rank={r}") for r in (0, 1)]
    outs = [p.communicate(timeout=100) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    for r, (out, _) in enumerate(outs):
        line = next(line for line in out.splitlines() if "sum=" in line)
        assert line == f"[rank{r}]: rank={r} world=2 local=0 lws=1 node={r} sum=3 foo=None args=['--local_rank=0']"


def test_each_rank_log_and_save_pid(tmp_path):
    tool = tmp_path / "tool.sh"
    tool.write_text('#!/bin/sh\necho "out $RANK"\necho "err $RANK" >&2\n')
    tool.chmod(0o755)
    launcher = subprocess.Popen(LAUNCHER + ["--num_procs=2", "--no_python", "--no_local_rank", "--save_pid",
                                            f"--enable_each_rank_log={tmp_path / 'logs'}", str(tool)],
                                cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    launcher.communicate(timeout=50)
    assert launcher.returncode == 0
    logs = tmp_path / "logs"
    assert [(logs / f"rank{r}.out").read_text() for r in (0, 1)] == ["out 0\n", "out 1\n"]
    assert [(logs / f"rank{r}.err").read_text() for r in (0, 1)] == ["err 0\n", "err 1\n"]
    pid_file = Path(f"/tmp/{launcher.pid}.deepspeed")
    try:
        pids = pid_file.read_text().split(",")
        assert len(pids) == 2 and all(p.isdigit() for p in pids)
    finally:
        pid_file.unlink(missing_ok=True)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_bind_cores_to_rank(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    script = "import os\nprint(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])\n"
    proc = _launch(tmp_path, script, "--num_procs=2", "--bind_cores_to_rank",
                   f"--bind_core_list={cores[0]},{cores[1]}")
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 0, err
    assert sorted(out.splitlines()) == [f"[rank0]: [{cores[0]}] 1", f"[rank1]: [{cores[1]}] 1"]

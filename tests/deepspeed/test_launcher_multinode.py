"""End-to-end multi-node paths through stand-in ``pdsh`` and ``mpirun`` programs that run every "node" here.

The stand-ins do what the real tools do with the command line the launcher builds: pdsh gives the remote
string to a shell once per host with ``%n`` replaced by the host index; mpirun starts N ranks with Open MPI's
rank variables and the ``-x`` exports. The ranks print their environment (no torch, to stay fast).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE_PDSH = textwrap.dedent("""
    import subprocess, sys
    args = sys.argv[1:]
    assert args[:3] == ["-S", "-f", "1024"] and args[3] == "-w", args
    hosts, remote = args[4].split(","), " ".join(args[5:])
    procs = [subprocess.Popen(["sh", "-c", remote.replace("%n", str(i))]) for i, _ in enumerate(hosts)]
    sys.exit(max(p.wait() for p in procs))
""")

FAKE_MPIRUN = textwrap.dedent("""
    import os, subprocess, sys
    args, env, n = sys.argv[1:], dict(os.environ), 0
    while not args[0].startswith("/"):
        flag = args.pop(0)
        if flag == "-n":
            n = int(args.pop(0))
        elif flag == "-x":
            key, _, val = args.pop(0).partition("=")
            env[key] = val
        elif flag == "--mca":
            del args[:2]
        else:
            args.pop(0)
    procs = []
    for rank in range(n):
        rank_env = dict(env, OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(n),
                        OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE=str(n))
        procs.append(subprocess.Popen(args, env=rank_env))
    sys.exit(max(p.wait() for p in procs))
""")

SHOW_ENV = ("import os, sys\nkeys = 'RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT FOO NCCL_DEBUG'.split()\n"
            "line = ' '.join(f'{k}={os.environ.get(k)}' for k in keys) + f' {sys.argv[1:]}\\n'\n"
            "os.write(1, line.encode())  # one write: the fake mpirun's ranks share one pipe\n")


def _bin(tmp_path: Path, name: str, source: str) -> None:
    tool = tmp_path / "bin" / name
    tool.parent.mkdir(exist_ok=True)
    tool.write_text(f"#!{sys.executable}\n{source}")
    tool.chmod(0o755)


def _run(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    (tmp_path / "show.py").write_text(SHOW_ENV)
    (tmp_path / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("FOO=bar baz\n")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "NCCL_DEBUG": "INFO",
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={tmp_path / 'hostfile'}",
           "--master_addr=127.0.0.1", "--master_port=4321", *flags, "show.py", "--opt", "a b"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(90)
def test_pdsh_path_runs_one_launcher_per_node(tmp_path):
    _bin(tmp_path, "pdsh", FAKE_PDSH)
    out = _run(tmp_path, "--no_ssh_check")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [
        f"[rank{r}]: RANK={r} LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=4321 FOO=bar baz "
        f"NCCL_DEBUG=INFO ['--local_rank=0', '--opt', 'a b']" for r in (0, 1)
    ]


@pytest.mark.timeout(90)
def test_openmpi_path_maps_mpi_ranks(tmp_path):
    _bin(tmp_path, "mpirun", FAKE_MPIRUN)
    _bin(tmp_path, "ompi_info", "print('Open MPI')\n")
    out = _run(tmp_path, "--launcher=openmpi", "--no_local_rank")
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [
        f"RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=4321 FOO=bar baz "
        f"NCCL_DEBUG=INFO ['--opt', 'a b']" for r in (0, 1)
    ]
    assert "cmd = mpirun -n 2 -H nodeA:1,nodeB:1" in out.stderr


def test_missing_backend_is_reported(tmp_path):
    (tmp_path / "bin").mkdir()
    out = _run(tmp_path, "--launcher=slurm")
    if out.returncode == 2:
        assert "launcher 'slurm' not installed ('sinfo' is not on PATH)" in out.stderr
    else:
        pytest.skip("this machine has Slurm installed")

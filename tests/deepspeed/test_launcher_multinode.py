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
    takes = {"-n": 1, "-hostfile": 1, "--mca": 2, "-mca": 2, "-x": 1}
    while args and args[0] in takes:
        flag, values = args[0], args[1:1 + takes[args[0]]]
        del args[:1 + takes[flag]]
        if flag == "-n":
            n = int(values[0])
        elif flag == "-x":
            key, _, val = values[0].partition("=")
            env[key] = val
    procs = []
    for rank in range(n):
        rank_env = dict(env, OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(n),
                        OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE=str(n))
        procs.append(subprocess.Popen(args, env=rank_env))
    sys.exit(max(p.wait() for p in procs))
""")

# DeepSpeed's OpenMPI command starts the script itself: init_distributed's discovery maps OMPI_COMM_WORLD_*.
SHOW_MPI_RANK = ("import os, sys\nfrom deepspeed.comm._env import discover_launch_env\n"
                 "e = discover_launch_env(29500)\n"
                 "line = (f'RANK={e.rank} LOCAL_RANK={e.local_rank} WORLD_SIZE={e.world_size} MASTER={e.master_addr} '"
                 " f\"UCX_TLS={os.environ.get('UCX_TLS')} FOO={os.environ.get('FOO')} \""
                 " f\"NCCL_DEBUG={os.environ.get('NCCL_DEBUG')} {sys.argv[1:]}\\n\")\n"
                 "os.write(1, line.encode())\n")

SHOW_ENV = ("import os, sys\nkeys = 'RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT FOO NCCL_DEBUG'.split()\n"
            "line = ' '.join(f'{k}={os.environ.get(k)}' for k in keys) + f' {sys.argv[1:]}\\n'\n"
            "os.write(1, line.encode())  # one write: the fake mpirun's ranks share one pipe\n")


def _bin(tmp_path: Path, name: str, source: str) -> None:
    tool = tmp_path / "bin" / name
    tool.parent.mkdir(exist_ok=True)
    tool.write_text(f"#!{sys.executable}\n{source}")
    tool.chmod(0o755)


def _run(tmp_path: Path, *flags: str, script: str = SHOW_ENV) -> subprocess.CompletedProcess:
    (tmp_path / "show.py").write_text(script)
    (tmp_path / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("FOO=bar baz\n")
    home = tmp_path / "home"
    home.mkdir()
    stale = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")  # from other tests
    env = {**{k: v for k, v in os.environ.items() if k not in stale}, "HOME": str(home), "NCCL_DEBUG": "INFO",
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
def test_openmpi_path_runs_the_script_under_mpirun(tmp_path):
    _bin(tmp_path, "mpirun", FAKE_MPIRUN)
    _bin(tmp_path, "ompi_info", "print('Open MPI')\n")
    out = _run(tmp_path, "--launcher=openmpi", script=SHOW_MPI_RANK)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [
        f"RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 MASTER=127.0.0.1 UCX_TLS=tcp FOO=bar baz NCCL_DEBUG=INFO "
        f"['--opt', 'a b']" for r in (0, 1)
    ]
    assert f"cmd = mpirun -n 2 -hostfile {tmp_path / 'hostfile'} --mca btl ^openib" in out.stderr


def test_missing_backend_is_reported(tmp_path):
    (tmp_path / "bin").mkdir()
    out = _run(tmp_path, "--launcher=slurm")
    if out.returncode == 2:
        assert "launcher 'slurm' not installed ('sinfo' is not on PATH)" in out.stderr
    else:
        pytest.skip("this machine has Slurm installed")

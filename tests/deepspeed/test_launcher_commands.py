"""Command lines the deepspeed launcher builds (exact argv), resource selection, env export, helper mapping."""

from __future__ import annotations

import base64
import collections
import json
import os
import subprocess
import sys

import pytest

from deepspeed.launcher import launch, launcher_helper, runner
from deepspeed.launcher._resources import exported_environment, read_deepspeed_env
from deepspeed.launcher.multinode_runner import (
    IMPIRunner,
    MPICHRunner,
    MVAPICHRunner,
    OpenMPIRunner,
    PDSHRunner,
    SlurmRunner,
)

PY = sys.executable
ACTIVE = collections.OrderedDict([("w0", [0, 1]), ("w1", [0, 1])])
HELPER = [PY, "-u", "-m", "deepspeed.launcher.launcher_helper"]


def _args(*extra: str):
    return runner.parse_args(["--master_addr=10.0.0.1", "--master_port=1234", *extra, "train.py", "--lr", "0.1"])


def test_pdsh_command_and_kill_command(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    pdsh = PDSHRunner(_args("--launcher_args=-R ssh", "--no_local_rank", "--ssh_port=2222"), "V0lO")
    pdsh.add_export("NCCL_DEBUG", "INFO")
    pdsh.add_export("PYTHONPATH", "/a b")
    env = {"PDSH_SSH_ARGS_APPEND": "-q"}
    cmd, kill_cmd, env = pdsh.get_cmd(env, ACTIVE)
    head = ["pdsh", "-S", "-f", "1024", "-w", "w0,w1", "-R", "ssh"]
    assert cmd == head + [
        f"export NCCL_DEBUG=INFO; export PYTHONPATH='/a b'; cd {tmp_path};",
        PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=V0lO", "--node_rank=%n",
        "--master_addr=10.0.0.1", "--master_port=1234", "--no_local_rank", "train.py", "--lr", "0.1",
    ]
    assert kill_cmd == head + ["pkill", "-f", "'deepspeed.launcher.launch --world_info=V0lO'"]
    assert env == {"PDSH_SSH_ARGS_APPEND": "-q -p 2222", "PDSH_RCMD_TYPE": "ssh"}


def test_pdsh_quotes_user_arguments_for_the_remote_shell(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = runner.parse_args(["--master_addr=h", "--module", "pkg.train", "--name", "a b;rm -rf x"])
    cmd, _, _ = PDSHRunner(args, "X").get_cmd({}, ACTIVE)
    assert cmd[-4:] == ["--module", "pkg.train", "--name", "'a b;rm -rf x'"]


def test_openmpi_command():
    mpi = OpenMPIRunner(_args("--launcher=openmpi", "--launcher_args=--bind-to none"), "X")
    mpi.add_export("NCCL_IB_DISABLE", "1")
    assert mpi.get_cmd({}, ACTIVE) == [
        "mpirun", "-n", "4", "-H", "w0:2,w1:2", "--mca", "btl", "^openib", "--bind-to", "none",
        "-x", "MASTER_ADDR=10.0.0.1", "-x", "MASTER_PORT=1234", "-x", "NCCL_IB_DISABLE=1",
        *HELPER, "--launcher=openmpi", "--master_addr=10.0.0.1", "--master_port=1234",
        "train.py", "--lr", "0.1",
    ]


@pytest.mark.parametrize("cls, name", [(MPICHRunner, "mpich"), (IMPIRunner, "impi")])
def test_mpich_and_impi_commands(cls, name):
    mpi = cls(_args(f"--launcher={name}", "--module"), "X")
    mpi.add_export("PYTHONPATH", "/p")
    assert mpi.get_cmd({}, ACTIVE) == [
        "mpirun", "-n", "4", "-ppn", "2", "-hosts", "w0,w1",
        "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "1234", "-genv", "PYTHONPATH", "/p",
        *HELPER, f"--launcher={name}", "--master_addr=10.0.0.1", "--master_port=1234", "--module",
        "train.py", "--lr", "0.1",
    ]


def test_mvapich_command_sets_mv2_variables():
    cmd = MVAPICHRunner(_args("--launcher=mvapich", "--no_python"), "X").get_cmd({}, {"w0": [0]})
    assert cmd[:7] == ["mpirun", "-n", "1", "-ppn", "1", "-hosts", "w0"]
    assert ["-genv", "MV2_SUPPORT_DL", "1"] == cmd[cmd.index("MV2_SUPPORT_DL") - 1: cmd.index("MV2_SUPPORT_DL") + 2]
    assert cmd[-5:] == ["--master_port=1234", "--no_python", "train.py", "--lr", "0.1"]


def test_slurm_command():
    srun = SlurmRunner(_args("--launcher=slurm", "--launcher_args=--partition=gpu"), "X")
    srun.add_export("NCCL_DEBUG", "WARN")
    assert srun.get_cmd({}, ACTIVE) == [
        "srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--nodelist=w0,w1", "--partition=gpu",
        "--export=ALL,MASTER_ADDR=10.0.0.1,MASTER_PORT=1234,NCCL_DEBUG=WARN",
        *HELPER, "--launcher=slurm", "--master_addr=10.0.0.1", "--master_port=1234", "train.py", "--lr", "0.1",
    ]
    srun.add_export("X", "a,b")
    with pytest.raises(ValueError, match="cannot export values containing ','"):
        srun.get_cmd({}, ACTIVE)


def test_mpi_launchers_reject_what_they_cannot_express():
    with pytest.raises(ValueError, match=r"cannot use slots \[0, 2\] of host 'w1'"):
        OpenMPIRunner(_args(), "X").get_cmd({}, {"w0": [0, 1], "w1": [0, 2]})
    with pytest.raises(ValueError, match="same number of ranks on every host"):
        MPICHRunner(_args(), "X").get_cmd({}, {"w0": [0, 1], "w1": [0]})
    with pytest.raises(ValueError, match="--launcher_args"):
        OpenMPIRunner(_args("--launcher_args=-x 'unclosed"), "X")


def test_unknown_launcher_is_rejected(capsys):
    with pytest.raises(SystemExit):
        runner.parse_args(["--launcher=torque", "t.py"])
    assert "invalid choice: 'torque'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "launcher, env, expected",
    [
        ("openmpi", {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                     "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, ("5", "8", "1", "4")),
        ("mpich", {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
         ("3", "4", "1", "2")),
        ("mvapich", {"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0",
                     "MV2_COMM_WORLD_LOCAL_SIZE": "2"}, ("2", "4", "0", "2")),
        ("slurm", {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
                   "SLURM_TASKS_PER_NODE": "3(x2),1"}, ("6", "7", "0", "1")),
    ],
)
def test_launcher_helper_maps_rank_variables(launcher, env, expected):
    out = launcher_helper.rank_environment(launcher, env, "10.0.0.1", 1234)
    assert (out["RANK"], out["WORLD_SIZE"], out["LOCAL_RANK"], out["LOCAL_WORLD_SIZE"]) == expected
    assert out["LOCAL_SIZE"] == expected[3] and out["MASTER_ADDR"] == "10.0.0.1" and out["MASTER_PORT"] == "1234"


def test_launcher_helper_exec_line_and_missing_variables():
    args = launcher_helper.parse_args(["--launcher=mpich", "--master_addr=h", "--module", "pkg.train", "-x"])
    cmd, env = launcher_helper.build_exec(args, {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                                                 "MPI_LOCALNRANKS": "2"})
    assert cmd == [PY, "-u", "-m", "pkg.train", "--local_rank=1", "-x"] and env["RANK"] == "1"
    with pytest.raises(RuntimeError, match="did not set any of PMI_RANK"):
        launcher_helper.rank_environment("impi", {}, "h", 1)


def test_launch_assigns_global_ranks_by_host_order():
    info = base64.urlsafe_b64encode(json.dumps({"a": [0, 1], "b": [2, 3, 5]}).encode()).decode()
    args = launch.parse_args([f"--world_info={info}", "--node_rank=1", "--master_addr=h", "--master_port=9",
                              "train.py", "x"])
    specs = launch.build_rank_specs(args, {"KEEP": "1"})
    assert [s.rank for s in specs] == [2, 3, 4]
    assert specs[2].cmd == [PY, "-u", "train.py", "--local_rank=2", "x"]
    env = specs[2].env
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["LOCAL_SIZE"]) == (
        "4", "2", "5", "3", "3")
    assert (env["CROSS_RANK"], env["CROSS_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"], env["KEEP"]) == (
        "1", "2", "h", "9", "1")
    bad = launch.parse_args([f"--world_info={info}", "--node_rank=2", "train.py"])
    with pytest.raises(ValueError, match=r"--node_rank=2 is out of range: --world_info lists 2 node\(s\)"):
        launch.build_rank_specs(bad, {})


def test_select_resources(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=4\nb slots=4\nc slots=4\n")
    h = f"--hostfile={hostfile}"
    sel = runner.select_resources
    assert sel(runner.parse_args([h, "t.py"]), {})[0] == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1, 2, 3]}
    assert sel(runner.parse_args([h, "--num_nodes=2", "--num_gpus=2", "t.py"]), {})[0] == {"a": [0, 1],
                                                                                           "b": [0, 1]}
    assert sel(runner.parse_args([h, "--exclude=a@c:1,3", "t.py"]), {})[0] == {"b": [0, 1, 2, 3], "c": [0, 2]}
    with pytest.raises(ValueError, match="cannot be combined with --include/--exclude"):
        sel(runner.parse_args([h, "--num_gpus=2", "--include=a", "t.py"]), {})
    with pytest.raises(ValueError, match="--num_nodes=4 but only 3 node"):
        sel(runner.parse_args([h, "--num_nodes=4", "t.py"]), {})
    with pytest.raises(ValueError, match="does not exist"):
        sel(runner.parse_args([f"--hostfile={tmp_path / 'missing'}", "t.py"]), {})
    local = sel(runner.parse_args([f"--hostfile={runner.DLTS_HOSTFILE}", "--num_procs=3", "t.py"]), {})
    if not os.path.exists(runner.DLTS_HOSTFILE):
        assert local == ({"localhost": [0, 1, 2]}, False)


def test_deepspeed_env_files(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("# comment\nNCCL_DEBUG=INFO\nFOO=home\n\n")
    (cwd / ".deepspeed_env").write_text("export FOO = a=b c\n")
    assert read_deepspeed_env([str(home), str(cwd)]) == {"NCCL_DEBUG": "INFO", "FOO": "a=b c"}
    (cwd / ".deepspeed_env").write_text("FOO=1\nnot a pair\n")
    with pytest.raises(ValueError, match=r"\.deepspeed_env:2: bad line 'not a pair'"):
        read_deepspeed_env([str(cwd)])


def test_exported_environment_prefixes_and_excludes():
    env = {"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "UCX_TLS": "rc", "HOME": "/root",
           "MV2_X": "1", "MLFLOW_URI": "u"}
    assert exported_environment(env) == {k: v for k, v in env.items() if k != "HOME"}
    assert "NCCL_IB_HCA" not in exported_environment({**env, "AISC_JOB_NAME": "j"})


def test_runner_start_up_does_not_import_torch():
    code = ("import sys, deepspeed.launcher.runner, deepspeed.launcher.launch, deepspeed.launcher.launcher_helper;"
            "print('torch' in sys.modules)")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_core_lists_and_split():
    from deepspeed.launcher._resources import parse_core_list, split_cores

    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    assert parse_core_list("4,0-1,4") == [4, 0, 1]
    for bad in ("", "a", "3-1", "1,,2", "1-"):
        with pytest.raises(ValueError, match="bad item"):
            parse_core_list(bad)
    assert split_cores([0, 1, 2, 3, 4], 2) == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match="cannot bind 3 ranks to 2 core"):
        split_cores([0, 1], 3)


def test_bind_core_list_needs_bind_cores_to_rank():
    args = launch.parse_args(["--bind_core_list=0-1", "t.py"])
    with pytest.raises(ValueError, match="--bind_core_list needs --bind_cores_to_rank"):
        launch.build_rank_specs(args, {})
    specs = launch.build_rank_specs(launch.parse_args(["--bind_cores_to_rank", "--bind_core_list=5-8", "t.py"]), {})
    assert specs[0].cpus == (5, 6, 7, 8) and specs[0].env["OMP_NUM_THREADS"] == "4"


def test_visible_devices_mapping():
    assert launch._visible_devices([0, 2], None) == "0,2"
    assert launch._visible_devices([1], "GPU-a, GPU-b") == "GPU-b"
    with pytest.raises(ValueError, match="do not fit CUDA_VISIBLE_DEVICES='3'"):
        launch._visible_devices([0, 1], "3")


@pytest.mark.parametrize("flag", ["--num_gpus=0", "--num_nodes=-3", "--num_procs=-2"])
def test_non_positive_counts_are_rejected(flag):
    with pytest.raises(ValueError, match="use a positive count or -1"):
        runner.select_resources(runner.parse_args([flag, "t.py"]), {})


def test_no_ssh_needs_master_addr_and_node_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "hosts").write_text("n0 slots=1\nn1 slots=1\n")
    base = [f"--hostfile={tmp_path / 'hosts'}", "--no_ssh"]
    with pytest.raises(ValueError, match="--no_ssh with several nodes needs --master_addr"):
        runner.run(runner.parse_args(base + ["t.py"]))
    with pytest.raises(ValueError, match=r"needs --node_rank in 0..1, got -1"):
        runner.run(runner.parse_args(base + ["--master_addr=127.0.0.1", "t.py"]))
    with pytest.raises(ValueError, match=r"needs --node_rank in 0..1, got 2"):
        runner.run(runner.parse_args(base + ["--master_addr=127.0.0.1", "--node_rank=2", "t.py"]))

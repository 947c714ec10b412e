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
from deepspeed.launcher.multinode_runner import (
    HELPER_SCRIPT,
    IMPIRunner,
    MPICHRunner,
    MVAPICHRunner,
    OpenMPIRunner,
    PDSHRunner,
    SlurmRunner,
)
from deepspeed.launcher.resources import exported_environment, read_deepspeed_env

PY = sys.executable
ACTIVE = collections.OrderedDict([("w0", [0, 1]), ("w1", [0, 1])])
POOL = collections.OrderedDict([("w0", 2), ("w1", 2)])  # the hostfile's resource pool


def _args(*extra: str):
    return runner.parse_args(["--master_addr=10.0.0.1", "--master_port=1234", *extra, "train.py", "--lr", "0.1"])


# The expected command lists below are DeepSpeed's get_cmd logic applied to these fixed arguments (its
# multinode_runner.py): same program, flags, order and exports.


def test_pdsh_command_and_kill_command(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    pdsh = PDSHRunner(_args("--launcher_args=-R ssh", "--no_local_rank", "--ssh_port=2222"), "V0lO")
    pdsh.add_export("NCCL_DEBUG", "INFO")
    pdsh.add_export("PYTHONPATH", "/a/b")
    env = {"PDSH_SSH_ARGS_APPEND": "-q"}
    cmd, kill_cmd, env = pdsh.get_cmd(env, ACTIVE)
    head = ["pdsh", "-S", "-f", "1024", "-w", "w0,w1", "-R", "ssh"]
    assert cmd == head + [
        "export NCCL_DEBUG=INFO; export PYTHONPATH=/a/b; ", f"cd {tmp_path};",
        PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=V0lO", "--node_rank=%n",
        "--master_addr=10.0.0.1", "--master_port=1234", "--no_local_rank", "--enable_each_rank_log=None",
        "train.py", "--lr", "0.1",
    ]
    # ours stops only this job's launchers (DeepSpeed's pattern matches every deepspeed launcher on the nodes)
    assert kill_cmd == head + ["pkill", "-f", "'deepspeed.launcher.launch --world_info=V0lO'"]
    assert env == {"PDSH_SSH_ARGS_APPEND": "-q -p 2222", "PDSH_RCMD_TYPE": "ssh"}


def test_pdsh_flags_in_deepspeed_order(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    args = _args("--no_python", "--module", "--save_pid", "--enable_each_rank_log=/logs")
    cmd, _, _ = PDSHRunner(args, "X", POOL).get_cmd({}, ACTIVE)  # a resource_pool is accepted and unused
    assert cmd[6:] == ["", f"cd {tmp_path};", PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=X",
                       "--node_rank=%n", "--master_addr=10.0.0.1", "--master_port=1234", "--no_python",
                       "--module", "--save_pid", str(os.getpid()), "--enable_each_rank_log=/logs", "train.py",
                       "--lr", "0.1"]


def test_pdsh_quotes_user_arguments_for_the_remote_shell(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = runner.parse_args(["--master_addr=h", "--module", "pkg.train", "--name", "a b;rm -rf x"])
    pdsh = PDSHRunner(args, "X")
    pdsh.add_export("FOO", "bar baz")
    cmd, _, _ = pdsh.get_cmd({}, ACTIVE)
    # DeepSpeed double-quotes arguments with spaces only; ours quotes every piece the shell could split
    assert cmd[-4:] == ["--enable_each_rank_log=None", "pkg.train", "--name", "'a b;rm -rf x'"]
    assert cmd[6] == "export FOO='bar baz'; "


def test_openmpi_command():
    mpi = OpenMPIRunner(_args("--launcher=openmpi", "--launcher_args=--bind-to none"), "X", POOL)
    mpi.add_export("NCCL_IB_DISABLE", "1")
    assert mpi.get_cmd({}, ACTIVE) == [
        "mpirun", "-n", "4", "-hostfile", "/job/hostfile", "--mca", "btl", "^openib",
        "--mca", "btl_tcp_if_include", "eth0", "--bind-to", "none",
        "-x", "UCX_TLS=tcp", "-x", "NCCL_IB_DISABLE=1", PY, "-u", "train.py", "--lr", "0.1",
    ]
    own_if = OpenMPIRunner(_args("--hostfile=/h", "--module", "--launcher_args=-mca btl_tcp_if_include ib0"), "X",
                           {"w0": 3})
    assert own_if.get_cmd({}, {"w0": [0, 1, 2]}) == [
        "mpirun", "-n", "3", "-hostfile", "/h", "--mca", "btl", "^openib", "-mca", "btl_tcp_if_include", "ib0",
        "-x", "UCX_TLS=tcp", PY, "-u", "-m", "train.py", "--lr", "0.1",
    ]
    no_python = OpenMPIRunner(_args("--no_python"), "X", {"w0": 1}).get_cmd({}, {"w0": [0]})
    assert no_python[-3:] == ["train.py", "--lr", "0.1"] and PY not in no_python


def test_mpich_command():
    mpi = MPICHRunner(_args("--launcher=mpich"), "X", POOL)
    mpi.add_export("PYTHONPATH", "/p")
    assert mpi.get_cmd({}, ACTIVE) == [
        "mpirun", "-n", "4", "-ppn", "2", "-genv", "PYTHONPATH=/p",
        "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "1234", "-genv", "WORLD_SIZE", "4",
        "-genv", "LOCAL_SIZE", "2", "-hosts", "w0,w1",
        PY, "-u", HELPER_SCRIPT, "--launcher", "mpich", "train.py", "--lr", "0.1",
    ]
    # --module goes to the helper (DeepSpeed's `python -m <path to launcher_helper.py>` cannot start)
    module = MPICHRunner(_args("--launcher=mpich", "--module"), "X", POOL).get_cmd({}, ACTIVE)
    assert module[module.index(HELPER_SCRIPT) - 2:] == [PY, "-u", HELPER_SCRIPT, "--launcher", "mpich", "--module",
                                                         "train.py", "--lr", "0.1"]
    assert os.path.isfile(HELPER_SCRIPT)


def test_impi_command():
    mpi = IMPIRunner(_args("--launcher=impi"), "X", POOL)
    mpi.add_export("PYTHONPATH", "/p")
    head = ["mpirun", "-ppn", "2", "-genv", "PYTHONPATH", "/p",
            "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT", "1234", "-genv", "WORLD_SIZE", "4",
            "-genv", "LOCAL_SIZE", "2", "-genv", "I_MPI_PIN", "0", "-hosts", "w0,w1"]
    ranks = []
    for rank in range(4):
        ranks += ([":"] if rank else []) + ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK",
                                            str(rank % 2), PY, "-u", "train.py", "--lr", "0.1"]
    assert mpi.get_cmd({}, ACTIVE) == head + ranks


def test_impi_binds_cores_per_rank():
    cmd = IMPIRunner(_args("--bind_cores_to_rank", "--bind_core_list=0-7"), "X", {"w0": 2}).get_cmd({}, {})
    assert cmd[3:6] == ["-genv", "OMP_NUM_THREADS", "4"]
    first, second = cmd.index("RANK"), len(cmd) - cmd[::-1].index("RANK") - 1
    assert cmd[first + 5:first + 8] == ["numactl", "-C", "0-3"] and cmd[second + 5:second + 8] == [
        "numactl", "-C", "4-7"]


@pytest.mark.parametrize("gpus", [0, 1])
def test_mvapich_command(monkeypatch, tmp_path, gpus):
    from deepspeed.launcher import multinode_runner

    hostfile = tmp_path / "mvapich_hosts"
    monkeypatch.setattr(multinode_runner, "MVAPICH_TMP_HOSTFILE", str(hostfile))
    monkeypatch.setattr(multinode_runner, "local_gpu_count", lambda: gpus)
    mv2 = ["MV2_SMP_USE_CMA=0", "MV2_DEBUG_SHOW_BACKTRACE=1"] + (["MV2_USE_CUDA=1"] if gpus else []) + [
        "MV2_SUPPORT_DL=1", "MV2_ENABLE_AFFINITY=0", "MV2_INTER_ALLGATHER_TUNING=5", "MV2_CUDA_USE_NAIVE=0"]
    cmd = MVAPICHRunner(_args("--launcher=mvapich"), "X", POOL).get_cmd({}, ACTIVE)
    assert cmd == ["mpirun", "-np", "4", "-ppn", "2", "--hostfile", str(hostfile)] + [
        a for var in mv2 for a in ("-env", var)] + [PY, "-u", "train.py", "--lr", "0.1"]
    assert hostfile.read_text() == "w0\nw1\n"


def test_slurm_command():
    srun = SlurmRunner(_args("--launcher=slurm", "--launcher_args=--partition=gpu"), "X", POOL)
    srun.add_export("NCCL_DEBUG", "WARN")
    assert srun.get_cmd({}, ACTIVE) == [
        "srun", "-n", "4", "--partition=gpu", "--export=ALL,NCCL_DEBUG=WARN", PY, "-u", "train.py", "--lr", "0.1",
    ]
    only_w1 = SlurmRunner(_args("--include=w1"), "X", POOL).get_cmd({}, {"w1": [0, 1]})
    assert only_w1 == ["srun", "-n", "2", "--nodelist", "w1", "--nodes", "1", "--export=ALL", PY, "-u", "train.py",
                       "--lr", "0.1"]
    per_node = SlurmRunner(_args("--num_nodes=2", "--num_gpus=1"), "X", POOL).get_cmd({}, {"w0": [0], "w1": [0]})
    assert per_node[:7] == ["srun", "-n", "2", "--nodes", "2", "--gpus-per-node", "1"]
    srun.add_export("X", "a,b")
    with pytest.raises(ValueError, match="cannot export values containing ','"):
        srun.get_cmd({}, ACTIVE)


def test_runner_constructors_are_positional_as_deepspeed():
    args = _args()
    for cls in (OpenMPIRunner, MPICHRunner, IMPIRunner, MVAPICHRunner, SlurmRunner):
        runner_ = cls(args, "X", POOL)
        assert (runner_.args, runner_.world_info_base64, runner_.resource_pool) == (args, "X", POOL)
        with pytest.raises(TypeError):
            cls(args, "X")  # DeepSpeed's constructors need the resource pool too
    assert PDSHRunner(args, "X").world_info_base64 == "X"


def test_launcher_args_is_optional():
    import argparse

    bare = argparse.Namespace(user_script="train.py", user_args=["-x"], hostfile="/h", master_addr="m",
                              master_port=1)
    assert OpenMPIRunner(bare, "X", {"w0": 1}).get_cmd({}, {"w0": [0]}) == [
        "mpirun", "-n", "1", "-hostfile", "/h", "--mca", "btl", "^openib", "--mca", "btl_tcp_if_include", "eth0",
        "-x", "UCX_TLS=tcp", PY, "-u", "train.py", "-x"]
    assert SlurmRunner(bare, "X", {"w0": 1}).get_cmd({}, {"w0": [0]})[:3] == ["srun", "-n", "1"]
    assert PDSHRunner(bare, "X").get_cmd({}, {"w0": [0]})[0][:6] == ["pdsh", "-S", "-f", "1024", "-w", "w0"]


def test_mpi_launchers_reject_what_they_cannot_express():
    for cls in (OpenMPIRunner, MPICHRunner, IMPIRunner, MVAPICHRunner):
        with pytest.raises(ValueError, match="backend does not support worker include/exclusion"):
            cls(_args("--include=w0"), "X", POOL)
        with pytest.raises(ValueError, match="backend does not support limiting num nodes/gpus"):
            cls(_args("--num_gpus=1"), "X", POOL)
    with pytest.raises(ValueError, match="same number of ranks on every host"):
        MPICHRunner(_args(), "X", {"w0": 2, "w1": 1}).get_cmd({}, {})
    with pytest.raises(ValueError, match="cannot select specific device ids, got \\[0, 2\\] on w1"):
        SlurmRunner(_args(), "X", POOL).get_cmd({}, {"w0": [0, 1], "w1": [0, 2]})
    with pytest.raises(ValueError, match="--launcher_args"):
        OpenMPIRunner(_args("--launcher_args=-x 'unclosed"), "X", POOL)


def test_runner_main_raises_value_error_and_the_cli_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("a slots=2\nb slots=2\n")
    hostfile = f"--hostfile={tmp_path / 'hosts'}"
    bad = [
        ([hostfile, "--num_gpus=1", "--include=a", "t.py"], "cannot be combined with --include/--exclude"),
        ([hostfile, "--include=c", "t.py"], "hostname 'c'"),
        ([hostfile, "--include=a", "--exclude=b", "t.py"], "mutually exclusive"),
        (["--num_nodes=2", f"--hostfile={tmp_path / 'none'}", "t.py"], "does not exist"),
        ([hostfile, "--launcher=openmpi", "--no_ssh_check", "--master_addr=a", "--include=a@b", "t.py"],
         "does not support worker include/exclusion"),
    ]
    for argv, match in bad:
        with pytest.raises(ValueError, match=match):
            runner.main(argv)
    monkeypatch.setattr(sys, "argv", ["deepspeed", hostfile, "--include=c", "t.py"])
    with pytest.raises(SystemExit) as exit_info:
        runner.main()  # the console script: one line, exit code 2
    assert exit_info.value.code == 2
    assert "deepspeed: error: hostname 'c'" in capsys.readouterr().err
    out = subprocess.run([PY, "-m", "deepspeed.launcher.runner", hostfile, "--include=c", "t.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "deepspeed: error: hostname 'c'" in out.stderr


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
    # DeepSpeed's MPICH command line: `launcher_helper.py --launcher mpich [--module] script args`, with
    # MASTER_ADDR/MASTER_PORT/WORLD_SIZE/LOCAL_SIZE from -genv; no --local_rank argument, as DeepSpeed's helper
    args = launcher_helper.parse_args(["--launcher", "mpich", "--module", "pkg.train", "-x"])
    env = {"PMIX_RANK": "1", "PMI_RANK": "1", "MPI_LOCALRANKID": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
           "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    cmd, rank_env = launcher_helper.build_exec(args, env)
    assert cmd == [PY, "-u", "-m", "pkg.train", "-x"]
    assert (rank_env["RANK"], rank_env["LOCAL_RANK"], rank_env["WORLD_SIZE"], rank_env["MASTER_ADDR"],
            rank_env["MASTER_PORT"]) == ("1", "1", "2", "h", "9")
    opt_in = launcher_helper.parse_args(["--local_rank_arg", "--master_addr=a", "t.py"])
    assert launcher_helper.build_exec(opt_in, env)[0] == [PY, "-u", "t.py", "--local_rank=1"]
    with pytest.raises(RuntimeError, match="did not set any of PMI_RANK"):
        launcher_helper.rank_environment("impi", {}, "h", 1)
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        launcher_helper.rank_environment("mpich", {k: v for k, v in env.items() if k != "MASTER_ADDR"})


def test_launcher_helper_runs_as_a_file(tmp_path):
    (tmp_path / "show.py").write_text("import os, sys; print(os.environ['RANK'], os.environ['LOCAL_RANK'], "
                                      "sys.argv[1:])")
    env = {**os.environ, "PMI_RANK": "3", "MPI_LOCALRANKID": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    out = subprocess.run([PY, "-u", HELPER_SCRIPT, "--launcher", "mpich", "show.py", "a"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3 1 ['a']"


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
    from deepspeed.launcher.resources import parse_core_list, split_cores

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

"""Elastic mode of the deepspeed launcher: torchrun command lines, flag validation, a real 2-process run."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepspeed.launcher import launch, runner
from deepspeed.launcher._elastic import ELASTIC_MAX_RESTARTS, ELASTIC_TRAINING_ID_DEFAULT
from deepspeed.launcher._hostfile import encode_world_info
from deepspeed.launcher.multinode_runner import PDSHRunner

PY = sys.executable
NO_JOB_HOSTFILE = pytest.mark.skipif(os.path.exists("/job/hostfile"), reason="a real /job/hostfile would be used")


@pytest.fixture(autouse=True)
def _no_gpus_no_run_id(monkeypatch):
    monkeypatch.setattr(launch, "local_gpu_count", lambda *a: 0)
    monkeypatch.delenv("ELASTIC_RUN_ID", raising=False)


def _node_cmd(runner_flags: list[str], world: dict[str, list[int]], node_rank: int = 0) -> list[str]:
    """What the runner hands the per-node launcher, and the torchrun command that launcher runs."""
    args = runner.parse_args(["--master_addr=10.0.0.1", "--master_port=1234", *runner_flags, "train.py", "--lr",
                              "0.1"])
    launch_args = runner.local_launch_args(args, encode_world_info(world), node_rank)
    return launch.elastic_spec(launch.parse_args(launch_args), {}).cmd


def test_flags_have_deepspeeds_names_and_defaults():
    args = runner.parse_args(["train.py"])
    assert (args.elastic_training, args.min_elastic_nodes, args.max_elastic_nodes) == (False, -1, -1)
    assert runner.local_launch_args(args, "W", 0)[-1] == "train.py"  # no elastic flags unless asked


def test_single_node_command_defaults_to_one_node():
    args = runner.parse_args(["--master_addr=10.0.0.1", "--master_port=1234", "--elastic_training", "train.py"])
    assert runner.local_launch_args(args, "W", 0) == [
        "--world_info=W", "--node_rank=0", "--master_addr=10.0.0.1", "--master_port=1234",
        "--enable_elastic_training", "--max_elastic_nodes=-1", "--min_elastic_nodes=-1", "train.py"]
    assert _node_cmd(["--elastic_training"], {"localhost": [0, 1]}) == [
        PY, "-u", "-m", "torch.distributed.run", "--nnodes=1:1", "--nproc_per_node=2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.1:1234", f"--rdzv_id={ELASTIC_TRAINING_ID_DEFAULT}",
        f"--max_restarts={ELASTIC_MAX_RESTARTS}", "train.py", "--lr", "0.1"]


def test_node_range_module_and_run_id(monkeypatch):
    monkeypatch.setenv("ELASTIC_RUN_ID", "job7")
    world = {"w0": [0, 1, 2], "w1": [0, 1, 2]}
    cmd = _node_cmd(["--elastic_training", "--min_elastic_nodes=2", "--max_elastic_nodes=4", "--module"], world, 1)
    assert cmd == [PY, "-u", "-m", "torch.distributed.run", "--nnodes=2:4", "--nproc_per_node=3",
                   "--rdzv_backend=c10d", "--rdzv_endpoint=10.0.0.1:1234", "--rdzv_id=job7", "--max_restarts=100",
                   "--module", "train.py", "--lr", "0.1"]
    # the maximum defaults to the number of nodes in the world info, as in DeepSpeed
    assert _node_cmd(["--elastic_training", "--no_python"], world)[4:6] == ["--nnodes=1:2", "--nproc_per_node=3"]
    assert "--no_python" in _node_cmd(["--elastic_training", "--no_python"], world)


def test_pdsh_passes_deepspeeds_elastic_flags(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    args = runner.parse_args(["--master_addr=10.0.0.1", "--master_port=1234", "--elastic_training",
                              "--min_elastic_nodes=1", "--max_elastic_nodes=3", "train.py", "--lr", "0.1"])
    cmd, _, _ = PDSHRunner(args, "V0lO").get_cmd({}, {"w0": [0, 1], "w1": [0, 1]})
    assert cmd == ["pdsh", "-S", "-f", "1024", "-w", "w0,w1", "", f"cd {tmp_path};",
                   PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=V0lO", "--node_rank=%n",
                   "--master_addr=10.0.0.1", "--master_port=1234", "--enable_each_rank_log=None",
                   "--enable_elastic_training", "--max_elastic_nodes=3", "--min_elastic_nodes=1",
                   "train.py", "--lr", "0.1"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--min_elastic_nodes=3", "--max_elastic_nodes=2"], "--min_elastic_nodes=3 is larger than --max_elastic_nodes=2"),
    (["--min_elastic_nodes=0"], "--min_elastic_nodes=0: the number of elastic nodes must be >= 1"),
    (["--max_elastic_nodes=-5"], "--max_elastic_nodes=-5: the number of elastic nodes must be >= 1"),
    (["--max_elastic_nodes=1"], "--max_elastic_nodes=1 but 2 nodes are selected (w0, w1)"),
    (["--launcher=openmpi"], "which the 'openmpi' launcher cannot start; use --launcher=pdsh or --no_ssh"),
    (["--bind_cores_to_rank"], "--bind_cores_to_rank/--bind_core_list: not supported with --elastic_training"),
    (["--save_pid"], "--save_pid: not supported with --elastic_training"),
])
def test_bad_elastic_flags_are_named(tmp_path, flags, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w0 slots=2\nw1 slots=2\n")
    args = runner.parse_args([f"--hostfile={hostfile}", "--master_addr=w0", "--elastic_training", *flags, "t.py"])
    with pytest.raises(ValueError) as err:
        runner.run(args)
    assert message in str(err.value)


@NO_JOB_HOSTFILE
@pytest.mark.parametrize("flag", ["--min_elastic_nodes=2", "--max_elastic_nodes=2"])
def test_elastic_node_counts_need_elastic_training(flag):
    with pytest.raises(ValueError, match=f"{flag} needs --elastic_training"):
        runner.run(runner.parse_args(["--num_procs=1", flag, "t.py"]))


def test_per_node_launcher_validates_too():
    world = encode_world_info({"w0": [0], "w1": [0]})
    bad = launch.parse_args([f"--world_info={world}", "--enable_elastic_training", "--min_elastic_nodes=3", "t.py"])
    with pytest.raises(ValueError, match="--min_elastic_nodes=3 is larger than --max_elastic_nodes=2"):
        launch.elastic_spec(bad, {})
    both = launch.parse_args([f"--world_info={world}", "--enable_elastic_training", "--module", "--no_python", "t"])
    with pytest.raises(ValueError, match="--module and --no_python are mutually exclusive"):
        launch.elastic_spec(both, {})


def _config(tmp_path: Path, elasticity: dict | None) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4} | ({"elasticity": elasticity} if elasticity else {})))
    return path


@NO_JOB_HOSTFILE
def test_deepspeed_config_must_accept_an_elastic_world_size(tmp_path):
    only_one_gpu = {"enabled": True, "max_train_batch_size": 4, "micro_batch_sizes": [2], "min_gpus": 1,
                    "max_gpus": 1, "version": 0.1}
    args = runner.parse_args(["--num_procs=2", "--elastic_training", "t.py", "--deepspeed_config",
                              str(_config(tmp_path, only_one_gpu))])
    with pytest.raises(ValueError) as err:
        runner.run(args)
    assert str(err.value) == (f"--min_elastic_nodes=1 --max_elastic_nodes=1 with 2 rank(s) per node give world "
                              f"sizes [2], none of which the 'elasticity' section of {tmp_path / 'ds.json'} "
                              "accepts (valid GPU counts: [1])")
    broken = dict(only_one_gpu, micro_batch_sizes=[8])  # micro batch above max_train_batch_size
    args.user_args = [f"--deepspeed_config={_config(tmp_path, broken)}"]
    with pytest.raises(ValueError, match=r"^--deepspeed_config '.*ds.json': "):
        runner.run(args)


@NO_JOB_HOSTFILE
def test_config_without_elasticity_only_warns(tmp_path, monkeypatch, caplog):
    from deepspeed.launcher._elastic import check_elastic_config

    path = _config(tmp_path, None)
    with caplog.at_level("WARNING", logger="deepspeed.launcher"):
        check_elastic_config(["--deepspeed_config", str(path)], 1, 1, 2)
    assert "has no enabled 'elasticity' section" in caplog.text
    check_elastic_config(["--other"], 1, 1, 2)  # no config given: nothing to check


# ---- a real elastic run: torch's elastic agent starts 2 local CPU workers that join a gloo group -------------

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    # one write(2) per line: the two ranks share the pipe, and print() writes text and newline separately
    os.write(1, (f"RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} sum={t.item():g} "
                 f"restarts={os.environ['TORCHELASTIC_MAX_RESTARTS']} args={sys.argv[1:]}\\n").encode())
    dist.destroy_process_group()
""")


def _torchrun_unavailable() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available in this torch build"
    if importlib.util.find_spec("torch.distributed.run") is None:
        return "torch.distributed.run (torchrun) is missing from this torch build"
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as err:
        return f"cannot open a local TCP port for the c10d rendezvous ({err})"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@NO_JOB_HOSTFILE
@pytest.mark.timeout(60)
def test_real_single_node_elastic_run(tmp_path):
    reason = _torchrun_unavailable()
    if reason:
        pytest.skip(f"torch.distributed.run cannot start here: {reason}")
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "home").mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("ELASTIC_RUN_ID", None)
    cmd = [PY, "-m", "deepspeed.launcher.runner", "--elastic_training", "--num_procs=2",
           f"--master_port={_free_port()}", "script.py", "--x", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RANK="))
    assert lines == [f"RANK={r} WORLD_SIZE=2 sum=3 restarts=100 args=['--x', '1']" for r in (0, 1)]

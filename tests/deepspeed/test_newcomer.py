"""What a new user meets first (issue 28): a CUDA build of torch on a machine without a GPU, the launcher's
rank prefixes on tracebacks, the main job's opening lines, ``python -m ds_config schema | head``, and the file
a missing checkpoint is reported with."""

from __future__ import annotations

import io
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

import deepspeed
from deepspeed.accelerator import get_accelerator, real_accelerator, set_accelerator
from deepspeed.launcher._procs import _Prefixer
from deepspeed.utils.logging import logger

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from gpt_run_info import run_rows  # noqa: E402

_CONSOLE = Path(sys.executable).with_name("deepspeed")
LAUNCHER = [str(_CONSOLE)] if _CONSOLE.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def ds_log():
    """The messages the DeepSpeed logger emits during the test (it does not propagate to pytest's caplog)."""
    handler = _Records()
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


@pytest.fixture
def cuda_build_without_gpu(monkeypatch):
    """torch names CUDA its accelerator while torch.cuda.is_available() is False (a CUDA wheel, no driver)."""
    monkeypatch.setattr(real_accelerator, "_current", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cuda_build_without_gpu_falls_back_to_cpu_with_one_line(cuda_build_without_gpu, monkeypatch, ds_log):
    monkeypatch.setenv("LOCAL_RANK", "0")
    accel = get_accelerator()
    assert accel.name == "cpu" and accel.communication_backend_name() == "gloo"
    assert len(ds_log) == 1, ds_log
    line = ds_log[0]
    assert line.startswith("accelerator: cpu (auto-detected) because torch ")
    assert "torch.cuda.is_available() is False" in line and "no NVIDIA driver or no visible GPU" in line
    assert "DS_ACCELERATOR=cpu" in line and "DS_ACCELERATOR=cuda" in line  # how to force either
    assert get_accelerator() is accel and len(ds_log) == 1  # chosen once per process


def test_fallback_names_cuda_visible_devices_and_is_quiet_off_local_rank_0(cuda_build_without_gpu, monkeypatch,
                                                                           ds_log):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert get_accelerator().name == "cpu"
    assert "CUDA_VISIBLE_DEVICES=''" in ds_log[0]
    monkeypatch.setattr(real_accelerator, "_current", None)
    monkeypatch.setenv("LOCAL_RANK", "1")  # one line per node, not one per rank
    assert get_accelerator().name == "cpu" and len(ds_log) == 1


def test_cuda_asked_for_explicitly_is_still_an_error(cuda_build_without_gpu, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR='cuda' but torch reports no usable CUDA device.*'cpu'"):
        get_accelerator()
    with pytest.raises(ValueError, match="set_accelerator='cuda' but torch reports no usable CUDA device"):
        set_accelerator("cuda")


def test_cpu_build_picks_cpu_silently(monkeypatch, ds_log):
    monkeypatch.setattr(real_accelerator, "_current", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert get_accelerator().name == "cpu" and ds_log == []


# Every rank fakes a CUDA build before DeepSpeed chooses; after a collective, rank 1 raises so that torch's
# excepthook (which writes "[rank1]: " itself) meets the launcher's prefix.
_FAKE_CUDA_RANK = textwrap.dedent("""
    import os
    import torch
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cuda")
    torch.cuda.is_available = lambda: False
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed()
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank={dist.get_rank()} accel={get_accelerator().name} backend={dist.get_backend()} sum={t.item():g}")
    dist.barrier()
    if dist.get_rank() == 1:
        raise RuntimeError("boom on purpose")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.path.exists("/job/hostfile"), reason="a real /job/hostfile would be used")
def test_launcher_on_a_cuda_build_without_gpu_runs_cpu_ranks_and_prefixes_once(tmp_path):
    (tmp_path / "script.py").write_text(_FAKE_CUDA_RANK)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(HOME=str(tmp_path), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(LAUNCHER + ["--num_gpus", "2", "--master_port", str(_free_port()), "script.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    out, err = proc.stdout, proc.stderr
    assert sorted(line for line in out.splitlines() if "accel=" in line) == [
        f"[rank{r}]: rank={r} accel=cpu backend=gloo sum=2" for r in (0, 1)], out + err
    assert out.count("accelerator: cpu (auto-detected)") == 1, out  # local rank 0 says it, once
    assert proc.returncode == 1
    assert "[rank1]: Traceback (most recent call last):" in err
    assert "[rank1]: RuntimeError: boom on purpose" in err
    assert "[rank1]: [rank1]:" not in err, err
    assert "Warning" not in out + err, out + err  # nothing else a user would wonder about (e.g. at exit)


def test_prefixer_does_not_double_a_prefix_the_rank_wrote_itself():
    sink = io.BytesIO()
    pump = _Prefixer(b"[rank3]: ", sink, threading.Lock(), None)
    pump.feed(b"[rank3]: Traceback (most recent call last):\nplain line\n[rank30]: other\n\n")
    assert sink.getvalue() == (b"[rank3]: Traceback (most recent call last):\n[rank3]: plain line\n"
                               b"[rank3]: [rank30]: other\n\n")


def _fake_engine(stage: int, *, bf16: bool = False, offload_optimizer=None, offload_param=None):
    config = SimpleNamespace(zero_stage=stage)
    return SimpleNamespace(
        _config=config, device=torch.device("cpu"), optimizer=None,
        basic_optimizer=torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]),
        zero_optimization_stage=lambda: stage, fp16_enabled=lambda: False, bfloat16_enabled=lambda: bf16,
        torch_autocast_enabled=lambda: False, train_batch_size=lambda: 32, train_micro_batch_size_per_gpu=lambda: 8,
        gradient_accumulation_steps=lambda: 2, optimizer_name=lambda: "adamw", optimizer_params=lambda: {"lr": 3e-3},
        scheduler_name=lambda: "WarmupLR", zero_offload_optimizer=lambda: offload_optimizer,
        zero_offload_param=lambda: offload_param)


def test_opening_rows_name_stage_precision_world_optimizer_and_offload():
    nvme = SimpleNamespace(device=SimpleNamespace(value="nvme"), nvme_path="/local_nvme")
    rows = run_rows(_fake_engine(3, bf16=True, offload_optimizer=SimpleNamespace(device="cpu"),
                                 offload_param=nvme), world_size=2, backend="gloo")
    assert list(rows) == ["zero", "precision", "world", "optimizer", "offload"]
    assert rows["zero"] == "stage 3 (optimizer states, gradients and parameters partitioned over 2 ranks)"
    assert rows["precision"] == "bf16 mixed precision (fp32 master weights)"
    assert rows["world"] == "2 ranks (gloo on cpu), global batch 32 = micro 8 x GAS 2 x 2 ranks"
    assert rows["optimizer"] == "adamw, lr 0.003 (runs as AdamW), lr schedule WarmupLR"
    assert rows["offload"] == "optimizer states -> cpu, parameters -> nvme (/local_nvme)"
    plain = run_rows(_fake_engine(0), world_size=1, backend="gloo")
    assert plain["zero"].startswith("stage 0 (off: every rank holds") and plain["precision"] == "fp32"
    assert plain["offload"] == "optimizer states -> none, parameters -> none"


def test_schema_into_a_pipe_closed_early_exits_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "ds_config", "schema"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0)
    first = proc.stdout.read(10)  # what `| head -c 10` reads before it closes the pipe
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141  # 128 + SIGPIPE, as a tool killed by the closed pipe
    assert first.startswith(b"{") and err == ""  # no BrokenPipeError traceback


def _load_missing_tag_zero3(tmp_path):
    messages = _Records()
    logger.addHandler(messages)
    try:
        model = torch.nn.Linear(4, 4)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        result = engine.load_checkpoint(str(tmp_path), tag="never_saved")
    finally:
        logger.removeHandler(messages)
    return dist.get_rank(), result, [m for m in messages.messages if "does not exist" in m]


@pytest.mark.timeout(120)
def test_missing_checkpoint_is_reported_with_each_ranks_own_file(tmp_path):
    results = run_distributed(_load_missing_tag_zero3, world_size=2, args=(tmp_path,), timeout=90)
    for rank, result, warned in results:
        assert result == (None, None)
        assert len(warned) == 1, warned
        own = os.path.join(str(tmp_path), "never_saved", f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        assert own in warned[0], (rank, warned)


def _readme_block(heading: str, lang: str, after: str | None = None) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading):]
    if after is not None:
        section = section[section.index(after):]
    start = section.index(f"```{lang}\n") + len(lang) + 4
    return section[start:section.index("```", start)]


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.path.exists("/job/hostfile"), reason="a real /job/hostfile would be used")
def test_readme_script_on_two_simulated_nodes(tmp_path):
    """The README's own-script example, run as its "two simulated nodes" commands say (another port): both nodes
    train one ZeRO-3 job, each rank writes its checkpoint shard, and nothing else is printed that a user would
    wonder about (no warnings, at exit included)."""
    (tmp_path / "train.py").write_text(_readme_block("## Your own script", "python"))
    (tmp_path / "ds_config.json").write_text(_readme_block("## Your own script", "json"))
    commands = _readme_block("## Your own script", "bash", after="Two simulated nodes").replace("\\\n", " ")
    lines = [line.split("#")[0].strip() for line in commands.splitlines() if line.strip()]
    assert lines[0].startswith("printf") and len(lines) == 3, lines
    subprocess.run(["bash", "-c", lines[0]], cwd=tmp_path, check=True)
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(HOME=str(tmp_path), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    nodes = [subprocess.Popen(["bash", "-c", line.replace("29600", port)], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for line in lines[1:]]
    outputs = [node.communicate(timeout=150)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "[rank0]: step 15 loss" in outputs[0], outputs[0]
    assert "Active resources: {'node0': [0], 'node1': [0]}" in outputs[1]
    shards = sorted(p.name for p in (tmp_path / "checkpoints" / "global_step20").iterdir())
    assert [s for s in shards if s.endswith("model_states.pt")] == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    for out in outputs:
        assert "Warning" not in out and "Traceback" not in out, out

"""The main job (examples/train_gpt.py): its data, model and progress output, and a quick run through the launcher."""

from __future__ import annotations

import fcntl
import io
import json
import math
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import tomllib
import torch

import deepspeed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from gpt_data import (  # noqa: E402
    NOUN_PL,
    NOUN_SG,
    VERB_I_PL,
    VERB_I_SG,
    VERB_T_PL,
    VERB_T_SG,
    VOCAB,
    Grammar,
    GrammarDataset,
    token_stream,
)
from gpt_model import GPT, GPTConfig  # noqa: E402
from gpt_progress import ProgressBar, RunRecord, console_columns, console_is_terminal, format_summary  # noqa: E402

_CONSOLE = Path(sys.executable).with_name("deepspeed")
LAUNCHER = [str(_CONSOLE)] if _CONSOLE.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]
HAS_INITIALIZE = hasattr(deepspeed, "initialize")


def test_token_stream_is_deterministic_and_seeded():
    a, b, c = token_stream(2000, seed=7), token_stream(2000, seed=7), token_stream(2000, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.dtype == torch.long and int(a.min()) >= 0 and int(a.max()) < len(VOCAB)


def test_grammar_agreement():
    """Subject and verb agree in number (the structure the model can learn).

    Without nested phrases (max_depth=0) every noun directly followed by a verb is that verb's subject; with
    them, "the cat near the dogs sleeps" is grammatical, so adjacency would not test agreement.
    """
    singular_verbs, plural_verbs = set(VERB_T_SG + VERB_I_SG), set(VERB_T_PL + VERB_I_PL)
    grammar = Grammar(seed=3, max_depth=0)
    words = [w for _ in range(300) for w in grammar.paragraph()]
    pairs = list(zip(words, words[1:], strict=False))
    plural = [(n, v) for n, v in pairs if n in NOUN_PL and v in singular_verbs | plural_verbs]
    singular = [(n, v) for n, v in pairs if n in NOUN_SG and v in singular_verbs | plural_verbs]
    assert len(plural) > 50 and len(singular) > 50
    assert all(v in plural_verbs for _, v in plural)
    assert all(v in singular_verbs for _, v in singular)
    assert words[-1] == "<eos>" and words.count("<eos>") == 300


def test_dataset_windows():
    ds = GrammarDataset(num_samples=10, block_size=16, seed=1)
    assert len(ds) == 10 and ds[3].shape == (17,)
    assert torch.equal(torch.cat([ds[i] for i in range(10)]), token_stream(170, seed=1))
    with pytest.raises(ValueError, match="num_samples"):
        GrammarDataset(num_samples=0, block_size=16)


def test_model_loss_and_causality():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(VOCAB), block_size=16, n_layer=2, n_head=2, d_model=32))
    batch = token_stream(4 * 17, seed=2).view(4, 17)
    loss = model(batch)
    assert abs(loss.item() - math.log(len(VOCAB))) < 0.2  # small init: close to uniform
    # changing a later token leaves the logits of earlier positions unchanged
    x = batch[:1, :16].clone()
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % len(VOCAB)
    torch.testing.assert_close(model.logits(x)[0, :10], model.logits(y)[0, :10])
    assert not torch.allclose(model.logits(x)[0, 10:], model.logits(y)[0, 10:])
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_head=4"):
        GPTConfig(vocab_size=8, d_model=30, n_head=4)


def test_progress_lines_only_when_not_a_terminal():
    """Not a terminal (a log, CI): the log lines and nothing else, no \r frames."""
    out = io.StringIO()
    bar = ProgressBar(4, stream=out)
    assert not bar.interactive
    for step in (1, 2):
        bar.update(step, loss=3.5, lr=1e-3)
    bar.log("step 2/4 loss 3.5")
    bar.close()
    assert out.getvalue() == "step 2/4 loss 3.5\n"


def test_progress_bar_on_a_terminal():
    """A terminal: a tqdm bar redrawn with \r, log lines printed whole above it, the final bar left on screen."""
    out = io.StringIO()
    bar = ProgressBar(4, stream=out, interactive=True, ncols=100)
    assert bar.interactive
    for step in (1, 2, 3, 4):
        bar.update(step, loss=3.5 - step / 10, lr=1e-3)
    bar.log("step 4/4 loss 3.1")
    bar.close()
    text = out.getvalue()
    frames = [f for f in re.split(r"[\r\n]", text) if f.strip()]
    assert "\r" in text and text.endswith("\n")
    assert "step 4/4 loss 3.1" in frames
    assert re.match(r"train: 100%\|.*\| 4/4 .*loss 3\.1000 lr 1\.0e-03", frames[-1]), frames
    quiet = io.StringIO()
    ProgressBar(4, enabled=False, stream=quiet, interactive=True).log("x")  # ranks other than 0
    assert quiet.getvalue() == ""


def test_progress_library_is_a_main_job_dependency():
    """The bar's library is installed by the default env (the one `hatch run main` uses), not only by tests."""
    with open(ROOT / "hatch.toml", "rb") as f:
        default = tomllib.load(f)["envs"]["default"]
    assert any(re.match(r"tqdm\b", dep) for dep in default["dependencies"]), default["dependencies"]
    assert not [d for d in default["dependencies"] if re.match(r"(pytest|tensorboard|wandb|comet)", d)]
    import tqdm  # noqa: F401  (the test env inherits the default env's dependencies)


def test_console_detection_pipe_file_and_pty(tmp_path):
    """stdout a file or a pipe nobody relays to a terminal: no bar; a pty: a bar."""
    assert console_columns(io.StringIO()) is None
    with open(tmp_path / "log", "w") as f:
        assert not console_is_terminal(f)
    read_end, write_end = os.pipe()  # our own pipe: the parent (pytest's runner) does not hold it
    with os.fdopen(write_end, "w") as w:
        assert not console_is_terminal(w)
    os.close(read_end)
    primary, secondary = pty.openpty()
    with os.fdopen(secondary, "w") as term:
        assert console_is_terminal(term)
    os.close(primary)


def test_progress_summary():
    record = RunRecord(losses=[4.0, 3.0, 2.0], step_times=[1.0, 0.5, 0.5], eval_before=4.1, eval_after=2.2,
                       peak_bytes=[2 * 1024**2, 3 * 1024**2])
    summary = format_summary(record, {"model": "m"}, global_batch=8, memory_kind="peak RSS")
    assert "4.0000 -> 2.0000" in summary and "4.1000 -> 2.2000" in summary
    assert "16.0 samples/s" in summary  # 2 steady steps x 8 samples / 1.0 s
    assert "rank0 2.0 MiB, rank1 3.0 MiB (peak RSS)" in summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
@pytest.mark.skipif(not HAS_INITIALIZE, reason="deepspeed.initialize is missing: the engine is not implemented yet")
@pytest.mark.skipif(os.path.exists("/job/hostfile"), reason="a real /job/hostfile would be used")
@pytest.mark.parametrize("zero_stage", [None, 3])  # the config's stage 2, and the README's one-flag switch to 3
def test_main_job_quick_run_through_launcher(tmp_path, zero_stage):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = LAUNCHER + ["--num_gpus", "2", "--master_port", str(_free_port()), str(EXAMPLES / "train_gpt.py"),
                      "--deepspeed", "--deepspeed_config", str(EXAMPLES / "gpt_ds_config.json"),
                      "--steps", "10", "--log_interval", "1", "--num_samples", "512"]
    if zero_stage is not None:
        cmd += ["--zero_stage", str(zero_stage)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=40)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "\r" not in proc.stdout + proc.stderr  # captured (not a terminal): periodic lines only, no bar frames
    lines = proc.stdout.splitlines()
    opening = proc.stdout[proc.stdout.index("[rank0]: run\n"):proc.stdout.index("[rank0]: step")]
    stage = 2 if zero_stage is None else zero_stage  # the config's stage, or the flag's, read back from the engine
    assert f"[rank0]:   zero       stage {stage} (" in opening, opening
    for row in ("precision  fp32", "world      2 ranks (gloo on cpu)", "optimizer  adamw, lr 0.003",
                "offload    optimizer states -> none, parameters -> none"):
        assert f"[rank0]:   {row}" in opening, opening
    for rank in (0, 1):
        assert any(re.match(rf"\[rank{rank}\]: rank {rank}/2 ready", line) for line in lines), proc.stdout
    losses = [float(m.group(1)) for line in lines if (m := re.match(r"\[rank0\]: step +\d+/10 +loss (\S+)", line))]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses), proc.stdout
    assert losses[-1] < losses[0] - 0.1, losses
    assert not [line for line in lines if re.match(r"\[rank1\]: (step |summary)", line)]  # rank 0 only
    summary = proc.stdout[proc.stdout.index("[rank0]: summary"):]
    first, last = map(float, re.search(r"loss +(\S+) -> (\S+) \(first -> last", summary).groups())
    assert (first, last) == (losses[0], pytest.approx(losses[-1], abs=1e-4))
    before, after = map(float, re.search(r"held-out loss +(\S+) -> (\S+)", summary).groups())
    assert after < before
    assert float(re.search(r"throughput +(\S+) samples/s", summary).group(1)) > 0
    peaks = re.search(r"peak memory +rank0 (\S+) MiB, rank1 (\S+) MiB", summary)
    assert peaks and all(float(v) > 50 for v in peaks.groups()), summary
    assert "sample" in summary


def _read_all(fd: int, timeout: float) -> bytes:
    """Everything written to a pty's secondary until every writer closed it (EIO) or ``timeout`` s passed."""
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other side is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not HAS_INITIALIZE, reason="deepspeed.initialize is missing: the engine is not implemented yet")
@pytest.mark.skipif(os.path.exists("/job/hostfile"), reason="a real /job/hostfile would be used")
def test_main_job_on_a_terminal_draws_a_bar_and_labels_the_window_loss(tmp_path):
    """The launcher's stdout on a terminal: rank 0 animates a bar (\r frames); the engine's steps_per_print line
    names its loss as the window mean, next to the job's per-step loss."""
    home = tmp_path / "home"
    home.mkdir()
    config = json.loads((EXAMPLES / "gpt_ds_config.json").read_text())
    config["steps_per_print"] = 2
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = LAUNCHER + ["--num_gpus", "2", "--master_port", str(_free_port()), str(EXAMPLES / "train_gpt.py"),
                      "--deepspeed", "--deepspeed_config", str(tmp_path / "ds_config.json"),
                      "--steps", "4", "--log_interval", "2", "--num_samples", "256"]
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=secondary,
                            stderr=secondary)
    os.close(secondary)
    try:
        text = _read_all(primary, timeout=60).decode(errors="replace")
        assert proc.wait(timeout=20) == 0, text[-3000:]
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
    assert "\r" in text
    frames = [f for f in re.split(r"\r\n|\r|\n", text) if f.startswith("[rank0]: train:")]
    assert any(re.search(r"\| 4/4 .*loss \S+ lr \S+", f) for f in frames), text[-3000:]
    assert re.search(r"\[rank0\]: step +4/4 +loss \S+", text), text[-3000:]  # log lines survive the bar
    lines = re.split(r"\r\n|\r|\n", text)
    windows = [m.groups() for line in lines
               if (m := re.match(r"\[rank0\]: \[.*\] step=(\d+), .*, loss\(avg of last (\d+) steps\)=\S+,", line))]
    assert windows == [("2", "2"), ("4", "2")], text[-3000:]  # whole lines of their own, not glued to a frame

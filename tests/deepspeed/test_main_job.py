"""The main job (examples/train_gpt.py): its data, model and progress output, and a quick run through the launcher."""

from __future__ import annotations

import io
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
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
from gpt_progress import ProgressBar, RunRecord, format_summary  # noqa: E402

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


def test_progress_bar_and_summary():
    out = io.StringIO()
    bar = ProgressBar(4, stream=out, width=8)
    bar.update(2, loss=3.5, lr=1e-3)
    bar.log("step 2/4 loss 3.5")
    bar.close()
    text = out.getvalue()
    assert text.startswith("train [####....] 2/4 loss 3.5000 lr 1.0e-03") and "\r" in text
    assert text.endswith("step 2/4 loss 3.5".ljust(len(text.split("\r")[0])) + "\n")
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
    lines = re.split(r"\r\n|\r|\n", proc.stdout)
    for rank in (0, 1):
        assert any(re.match(rf"\[rank{rank}\]: rank {rank}/2 ready", line) for line in lines), proc.stdout
    losses = [float(m.group(1)) for line in lines if (m := re.match(r"\[rank0\]: step +\d+/10 +loss (\S+)", line))]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses), proc.stdout
    assert losses[-1] < losses[0] - 0.1, losses
    assert any(re.match(r"\[rank0\]: train \[#+\] 10/10 loss", line) for line in lines)  # the progress bar
    assert not [line for line in lines if re.match(r"\[rank1\]: (train \[|step |summary)", line)]  # rank 0 only
    summary = proc.stdout[proc.stdout.index("[rank0]: summary"):]
    first, last = map(float, re.search(r"loss +(\S+) -> (\S+) \(first -> last", summary).groups())
    assert (first, last) == (losses[0], pytest.approx(losses[-1], abs=1e-4))
    before, after = map(float, re.search(r"held-out loss +(\S+) -> (\S+)", summary).groups())
    assert after < before
    assert float(re.search(r"throughput +(\S+) samples/s", summary).group(1)) > 0
    peaks = re.search(r"peak memory +rank0 (\S+) MiB, rank1 (\S+) MiB", summary)
    assert peaks and all(float(v) > 50 for v in peaks.groups()), summary
    assert "sample" in summary

"""``python -m ds_profiler PACKAGE.MODULE:FACTORY``: profiles what the factory returns; errors name the cause."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_profiler._cli import CliError, main, parse_shape

FACTORIES = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Tagger(nn.Module):
        def __init__(self, vocab=20, dim=8):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.out = nn.Linear(dim, 3)

        def forward(self, input_ids, attention_mask=None):
            return self.out(self.embed(input_ids))

    def mlp(width=6):
        return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))

    def tagger(dim=8):
        return Tagger(dim=dim)

    def broken():
        raise RuntimeError("no weights here")

    not_a_model = 3
    """
)


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "cli_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "cli_factories"
    sys.modules.pop("cli_factories", None)


def test_input_shape(factories, capsys):
    assert main([f"{factories}:mlp", "--input-shape", "3,4", "--factory-kwargs", '{"width": 5}']) == 0
    out = capsys.readouterr().out
    assert "(0): Linear(" in out
    assert out.strip().endswith("flops: 195  macs: 90 MACs  params: 37")  # 3*(4*5+5*2)=90 MACs, relu 15


def test_keyword_inputs_as_json(factories, capsys, tmp_path):
    target = tmp_path / "p.txt"
    code = main([f"{factories}:tagger", "--kwargs", '{"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]]}',
                 "--no-detailed", "--output-file", str(target), "--eval"])
    assert code == 0
    assert "macs: 72 MACs" in capsys.readouterr().out  # 3 tokens x 8 x 3
    assert "Detailed Profile" not in target.read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no_such_pkg.models:make", "--input-shape", "1"], "could not import module 'no_such_pkg.models'"),
        (["{m}:missing", "--input-shape", "1"], "has no attribute 'missing'"),
        (["{m}:broken", "--input-shape", "1"], "calling {m}:broken() failed: RuntimeError: no weights here"),
        (["{m}:not_a_model", "--input-shape", "1"], "is not callable"),
        (["{m}:mlp", "--input-shape", "1,x"], "--input-shape '1,x'"),
        (["{m}:mlp", "--kwargs", "[1]"], "--kwargs: expected a JSON object"),
        (["{m}:mlp"], "give --input-shape or --kwargs"),
        (["nocolon", "--input-shape", "1"], "PACKAGE.MODULE:FACTORY"),
        (["{m}:mlp", "--input-shape", "3,7"], "profiling {m}:mlp() with input shape (3, 7) (mode=forward) failed: "
                                             "RuntimeError"),
        (["{m}:tagger", "--kwargs", '{{"attention_mask": [[1]]}}'],
         "profiling {m}:tagger() with keyword inputs ['attention_mask'] (mode=forward) failed: TypeError"),
    ],
)
def test_errors_name_what_failed(factories, capsys, argv, message):
    assert main([a.format(m=factories) for a in argv]) == 2
    assert message.format(m=factories) in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "ds_profiler", "torch.nn:Linear", "--input-shape", "2,4",
                             "--factory-kwargs", '{"in_features": 4, "out_features": 3}', "--no-detailed"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "macs: 24 MACs" in result.stdout


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=10**6), min_size=1, max_size=6))
def test_parse_shape_round_trips(dims):
    assert parse_shape(",".join(map(str, dims))) == tuple(dims)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="0123456789,- x", min_size=1, max_size=12))
def test_parse_shape_accepts_only_positive_integer_lists(text):
    parts = text.split(",")
    valid = all(p.strip().isdigit() and int(p) > 0 for p in parts)
    if valid:
        assert parse_shape(text) == tuple(int(p) for p in parts)
    else:
        with pytest.raises(CliError, match="--input-shape"):
            parse_shape(text)

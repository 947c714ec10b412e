"""ZeRO memory estimators against the spec's "Memory Requirements" chapter (its printed tables to the digit),
the analytic formulas of its discussion, parameter counting, the HF-config path and the ds-estimate CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from _spec_docs import require_spec
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ds_zero.estimate import (
    GIB,
    EstimateRow,
    count_largest_layer_params,
    count_params,
    count_total_params,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    hf_config_params,
    parse_count,
    zero2_estimate_rows,
    zero2_model_to_params,
    zero3_estimate_rows,
    zero3_model_to_params,
)
from ds_zero.estimate.cli import main

# The spec's printed tables (api-reference, 13.1.1), rows as (per CPU, per GPU, Options).
SPEC_ZERO2_LIVE = [("127.48GB", "5.31GB", "offload_optimizer=cpu"), ("127.48GB", "15.93GB", "offload_optimizer=None")]
SPEC_ZERO2_COLD = [("127.45GB", "5.31GB", "offload_optimizer=cpu"), ("127.45GB", "15.93GB", "offload_optimizer=None")]
SPEC_ZERO3_LIVE = [
    ("71.71GB", "0.12GB", "offload_param=cpu , offload_optimizer=cpu , zero_init=1"),
    ("127.48GB", "0.12GB", "offload_param=cpu , offload_optimizer=cpu , zero_init=0"),
    ("63.74GB", "0.79GB", "offload_param=none, offload_optimizer=cpu , zero_init=1"),
    ("127.48GB", "0.79GB", "offload_param=none, offload_optimizer=cpu , zero_init=0"),
    ("1.47GB", "6.10GB", "offload_param=none, offload_optimizer=none, zero_init=1"),
    ("127.48GB", "6.10GB", "offload_param=none, offload_optimizer=none, zero_init=0"),
]
SPEC_ZERO3_COLD = [
    ("71.69GB", "0.12GB", "offload_param=cpu , offload_optimizer=cpu , zero_init=1"),
    ("127.45GB", "0.12GB", "offload_param=cpu , offload_optimizer=cpu , zero_init=0"),
    ("63.72GB", "0.78GB", "offload_param=none, offload_optimizer=cpu , zero_init=1"),
    ("127.45GB", "0.78GB", "offload_param=none, offload_optimizer=cpu , zero_init=0"),
    ("1.43GB", "6.09GB", "offload_param=none, offload_optimizer=none, zero_init=1"),
    ("127.45GB", "6.09GB", "offload_param=none, offload_optimizer=none, zero_init=0"),
]
SPEC_HW = "HW: Setup with 1 node, 8 GPUs per node."
SPEC_SW2 = "SW: Model with 2851M total params."
SPEC_SW3 = "SW: Model with 2851M total params, 32M largest layer params."
ROW = re.compile(r"^\s*(\d+\.\d\d)GB \|\s*(\d+\.\d\d)GB \| (.+)$")

# Architecture of the t5-3b / t5-large checkpoints the spec's examples load (config only; no weights).
T5_3B = dict(d_model=1024, d_ff=16384, d_kv=128, num_heads=32, num_layers=24, vocab_size=32128)
T5_LARGE = dict(d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24, vocab_size=32128)


def printed_rows(text: str) -> list[tuple[str, str, str]]:
    return [(f"{m[1]}GB", f"{m[2]}GB", m[3]) for m in map(ROW.match, text.splitlines()) if m]


def table_rows(rows: list[EstimateRow]) -> list[tuple[str, str, str]]:
    return [(f"{r.cpu_gb:.2f}GB", f"{r.gpu_gb:.2f}GB", r.options) for r in rows]


@pytest.fixture(scope="module")
def t5_3b_meta() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        return transformers.T5Model(transformers.T5Config(**T5_3B))


def test_embedded_spec_tables_are_the_spec_text():
    spec = (require_spec("api-reference.txt") / "api-reference.txt").read_text()  # skips locally, fails in CI
    for table in (SPEC_ZERO2_COLD, SPEC_ZERO2_LIVE, SPEC_ZERO3_LIVE, SPEC_ZERO3_COLD):
        for cpu, gpu, options in table:
            assert re.search(rf"{re.escape(cpu)}\t{re.escape(gpu)}\t(<code>)?{re.escape(options)}", spec)
    assert SPEC_HW in spec and SPEC_SW2 in spec and SPEC_SW3 in spec


def test_zero2_cold_reproduces_spec_table(capsys):
    rows = estimate_zero2_model_states_mem_needs_all_cold(total_params=2851e6, num_gpus_per_node=8, num_nodes=1)
    out = capsys.readouterr().out
    assert printed_rows(out) == SPEC_ZERO2_COLD == table_rows(rows)
    assert SPEC_HW in out.splitlines() and SPEC_SW2 in out.splitlines()


def test_zero3_cold_reproduces_spec_table(capsys):
    rows = estimate_zero3_model_states_mem_needs_all_cold(total_params=2851e6, largest_layer_params=32e6,
                                                          num_gpus_per_node=8, num_nodes=1)
    out = capsys.readouterr().out
    assert printed_rows(out) == SPEC_ZERO3_COLD == table_rows(rows)
    assert SPEC_HW in out.splitlines() and SPEC_SW3 in out.splitlines()


def test_live_tables_reproduce_spec_for_t5_3b(t5_3b_meta, capsys):
    assert zero3_model_to_params(t5_3b_meta) == (2851598336, 32899072)  # tied embeddings counted once
    rows2 = estimate_zero2_model_states_mem_needs_all_live(t5_3b_meta, num_gpus_per_node=8, num_nodes=1)
    out2 = capsys.readouterr().out
    rows3 = estimate_zero3_model_states_mem_needs_all_live(t5_3b_meta, num_gpus_per_node=8, num_nodes=1)
    out3 = capsys.readouterr().out
    assert printed_rows(out2) == SPEC_ZERO2_LIVE == table_rows(rows2)
    assert printed_rows(out3) == SPEC_ZERO3_LIVE == table_rows(rows3)
    assert SPEC_SW2 in out2 and SPEC_SW3 in out3  # 2851.6M and 32.9M print truncated


def test_spec_t5_large_gpu_example():
    """The discussion's worked example: t5-large on 4 GPUs, MB = bytes >> 20."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.T5Model(transformers.T5Config(**T5_LARGE))
    total, largest = zero3_model_to_params(model)
    assert (f"{total / 1e6:6.2f}M", f"{largest / 1e6:6.2f}M") == ("737.67M", " 32.90M")
    figures = {}
    for case, (optimizer, params) in {1: (False, False), 2: (True, True), 3: (True, False)}.items():
        _, gpu, layer = estimate_zero3_model_states_mem_needs(total, largest, 4, 1, optimizer, params)
        figures[case] = int(gpu) >> 20
    assert int(layer) >> 20 == 125
    assert figures == {1: 3291, 2: 125, 3: 477}


@pytest.mark.parametrize("gpus,nodes", [(1, 1), (8, 1), (4, 2), (3, 5)])
def test_raw_figures_follow_the_documented_formulas(gpus, nodes):
    params, largest, b = 1_234_567_891, 7_654_321, 1.25
    total_gpus, gpus_factor = gpus * nodes, 1 / nodes
    assert estimate_zero2_model_states_mem_needs(params, gpus, nodes, True, b) == (
        params * max(4 * gpus, 16) * b, 2 * params)
    assert estimate_zero2_model_states_mem_needs(params, gpus, nodes, False, b) == (
        params * 4 * gpus * b, 4 * params + int(16 * params / total_gpus))
    layer = 4 * largest
    expected = {  # (offload_optimizer, offload_param, zero_init) -> (cpu, gpu)
        (True, True, True): (params * 18 * gpus_factor * b, layer),
        (True, True, False): (params * max(4 * gpus, 18 * gpus_factor) * b, layer),
        (True, False, True): (params * 16 * gpus_factor * b, layer + int(2 * params / total_gpus)),
        (True, False, False): (params * max(4 * gpus, 16 * gpus_factor) * b, layer + int(2 * params / total_gpus)),
        (False, False, True): (largest * 4 * gpus * b, layer + int(18 * params / total_gpus)),
        (False, False, False): (params * 4 * gpus * b, layer + int(18 * params / total_gpus)),
    }
    for (optimizer, offload_params, zero_init), (cpu, gpu) in expected.items():
        got = estimate_zero3_model_states_mem_needs(params, largest, gpus, nodes, optimizer, offload_params,
                                                    zero_init, b)
        assert got[0] == pytest.approx(cpu, rel=1e-12) and got[1:] == (gpu, layer)


def test_rows_carry_the_options_and_figures():
    rows = zero3_estimate_rows(10e9, 100e6, num_gpus_per_node=4, num_nodes=2)
    assert [(r.offload_param, r.offload_optimizer, r.zero_init) for r in rows] == [
        ("cpu", "cpu", True), ("cpu", "cpu", False), ("none", "cpu", True), ("none", "cpu", False),
        ("none", "none", True), ("none", "none", False)]
    assert rows[0].cpu_mem == 10e9 * 18 * 0.5 * 1.5 and rows[0].gpu_gb == 400e6 / GIB
    assert [r.offload_optimizer for r in zero2_estimate_rows(1e9)] == ["cpu", "none"]
    record = rows[4].as_dict()
    assert json.loads(json.dumps(record))["options"].startswith("offload_param=none, offload_optimizer=none")


def test_header_pluralisation(capsys):
    estimate_zero2_model_states_mem_needs_all_cold(1e9, num_gpus_per_node=1, num_nodes=2)
    assert "HW: Setup with 2 nodes, 1 GPU per node." in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("kwargs,match", [
    (dict(total_params=-1), "total_params must be a finite number >= 0, got -1"),
    (dict(total_params=float("nan")), "total_params"),
    (dict(total_params=1e9, num_gpus_per_node=0), "num_gpus_per_node must be an int >= 1, got 0"),
    (dict(total_params=1e9, num_nodes=1.5), "num_nodes must be an int >= 1, got 1.5"),
    (dict(total_params=1e9, additional_buffer_factor=0), "additional_buffer_factor must be a finite number > 0"),
])
def test_bad_inputs_are_named(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        estimate_zero2_model_states_mem_needs(**kwargs)


def test_bad_counts_for_zero3():
    with pytest.raises(ValueError, match=r"largest_layer_params \(2000000000.0\) cannot exceed total_params"):
        estimate_zero3_model_states_mem_needs(1e9, 2e9)
    with pytest.raises(TypeError, match="total_params must be a number of parameters"):
        estimate_zero3_model_states_mem_needs("1e9", 1e6)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        estimate_zero2_model_states_mem_needs_all_live(5)


def _tiny_net() -> nn.Module:
    net = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 50, bias=False))
    net[3].weight = net[0].weight  # tied like an LM head: counted once
    return net


def test_counting_tied_shared_and_meta_models():
    net = _tiny_net()
    expected_total = 50 * 8 + 8 * 16 + 16
    assert count_total_params(net) == zero2_model_to_params(net) == expected_total
    assert count_largest_layer_params(net) == 400
    with torch.device("meta"):
        meta = _tiny_net()
    assert count_params(meta) == count_params(net)
    # distinct Parameter objects over the same memory count once (DeepSpeed keys on data_ptr)
    aliased = nn.Module()
    aliased.a = nn.Parameter(torch.zeros(10))
    aliased.b = nn.Parameter(aliased.a.data)
    assert count_total_params(aliased) == 10
    # distinct meta parameters all report data_ptr 0 yet must all count
    with torch.device("meta"):
        two = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert count_total_params(two) == 40 and count_largest_layer_params(two) == 20


def test_live_equals_cold_with_counted_params(capsys):
    net = _tiny_net()
    live = estimate_zero3_model_states_mem_needs_all_live(net, num_gpus_per_node=2, num_nodes=3)
    live_out = capsys.readouterr().out
    cold = estimate_zero3_model_states_mem_needs_all_cold(count_total_params(net), 400, 2, 3)
    assert live == cold and live_out == capsys.readouterr().out


@given(st.integers(min_value=0, max_value=10**15))
def test_parse_count_round_trips(n):
    assert parse_count(str(n)) == n
    assert parse_count(f"{n}K") == n * 1000
    assert parse_count(f"{n:_}") == n


def test_parse_count_forms_and_rejections():
    assert parse_count("2851e6") == 2_851_000_000
    assert parse_count("2.851B") == 2_851_000_000 and parse_count("32m") == 32_000_000
    assert parse_count(" 1.5t ") == 1_500_000_000_000
    for bad in ("", "abc", "-5", "1.5", "nan", "inf", "1e30", "2.5e0", "M"):
        with pytest.raises(ValueError, match="not a parameter count"):
            parse_count(bad)


def _gpt2_config():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16,
                                   bos_token_id=0, eos_token_id=0)


def test_hf_config_counts_match_a_real_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = _gpt2_config()
    for auto_class, model_cls in (("AutoModel", transformers.GPT2Model),
                                  ("AutoModelForCausalLM", transformers.GPT2LMHeadModel)):
        real = count_params(model_cls(config))
        assert hf_config_params(config, auto_class=auto_class) == real
    config.save_pretrained(tmp_path)
    expected = count_params(transformers.GPT2Model(config))
    assert hf_config_params(tmp_path) == expected  # a directory holding config.json
    assert hf_config_params(str(tmp_path / "config.json")) == expected


def test_hf_config_errors(tmp_path, monkeypatch):
    config = _gpt2_config()
    with pytest.raises(ValueError, match="auto_class must name a transformers Auto class.*'GPT2Model'"):
        hf_config_params(config, auto_class="GPT2Model")
    bad = tmp_path / "cfg.json"
    bad.write_text(json.dumps({"n_layer": 2}))
    with pytest.raises(ValueError, match="has no 'model_type' key"):
        hf_config_params(bad)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf_config_params(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install transformers"):
        hf_config_params(config)


def test_cli_prints_the_same_tables(capsys):
    assert main(["--params", "2851e6", "--largest-layer", "32e6", "--gpus-per-node", "8", "--nodes", "1",
                 "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert printed_rows(out) == SPEC_ZERO3_COLD and SPEC_SW3 in out
    assert main(["--params", "2851e6", "--gpus-per-node", "8"]) == 0  # no largest layer: ZeRO-2 only
    out = capsys.readouterr().out
    assert printed_rows(out) == SPEC_ZERO2_COLD and "ZeRO-3" not in out


def test_cli_json_and_hf_config(tmp_path, capsys):
    _gpt2_config().save_pretrained(tmp_path)
    assert main(["--hf-config", str(tmp_path), "--gpus-per-node", "2", "--json", "--buffer-factor", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    counts = hf_config_params(tmp_path)
    assert (data["total_params"], data["largest_layer_params"]) == (counts.total_params, counts.largest_layer_params)
    assert sorted(data["stages"]) == ["2", "3"] and len(data["stages"]["3"]) == 6
    assert data["stages"]["2"][0]["cpu_mem"] == counts.total_params * 16 * 2


@pytest.mark.parametrize("argv,message", [
    (["--params", "1e9", "--stage", "3"], "--stage 3 needs --largest-layer"),
    (["--params", "1e9", "--gpus-per-node", "0"], "--gpus-per-node must be an int >= 1, got 0"),
    (["--params", "lots"], "not a parameter count: 'lots'"),
    (["--params", "1e9", "--hf-config", "gpt2"], "not allowed with argument"),
    (["--params", "1e9", "--buffer-factor", "-1"], "additional_buffer_factor must be a finite number > 0"),
])
def test_cli_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_and_import_hygiene():
    code = ("import sys, runpy; import ds_zero.estimate; "
            "assert 'deepspeed' not in sys.modules and 'transformers' not in sys.modules; "
            "import torch.distributed as d; assert not d.is_initialized(); "
            "sys.argv = ['ds-estimate', '--params', '2851e6', '--gpus-per-node', '8']; "
            "runpy.run_module('ds_zero.estimate', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert printed_rows(proc.stdout) == SPEC_ZERO2_COLD


def test_cli_resolves_a_cached_hub_name_offline(tmp_path):
    """A hub model name whose config is in the local HF cache: resolved without network, weights never fetched."""
    config = _gpt2_config()
    repo = tmp_path / "models--tiny-org--tiny-gpt2"
    revision = "0123456789abcdef0123456789abcdef01234567"
    config.save_pretrained(repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "ds_zero.estimate", "--hf-config", "tiny-org/tiny-gpt2", "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    counts = hf_config_params(config)
    assert (data["total_params"], data["largest_layer_params"]) == (counts.total_params, counts.largest_layer_params)

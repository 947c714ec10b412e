"""``python -m ds_config validate FILE [--world-size N] [--no-strict] [--print-resolved] [--json]`` and
``python -m ds_config schema``: exit codes, the one-line verdict, the batch check without a world size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_config import config_schema
from ds_config.__main__ import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ds_config.json"


def _write(tmp_path: Path, data: object, name: str = "c.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_validate_prints_a_one_line_verdict(capsys):
    assert main(["validate", str(EXAMPLE), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("OK ")
    assert "train_batch_size 16 = micro 4 x GAS 2 x world size 2" in out and "0 warning(s)" in out


def test_print_resolved_prints_the_config_and_the_verdict_on_stderr(capsys):
    assert main(["validate", str(EXAMPLE), "--world-size", "2", "--print-resolved"]) == 0
    captured = capsys.readouterr()
    resolved = json.loads(captured.out)  # stdout is the config alone, so ``> resolved.json`` works
    assert resolved["train_batch_size"] == 16 and resolved["fp16"]["loss_scale_window"] == 1000
    assert resolved["zero_optimization"]["stage"] == 2
    assert captured.err.startswith("OK ") and "train_batch_size 16" in captured.err


def test_json_report_for_scripts(tmp_path, capsys):
    assert main(["validate", str(EXAMPLE), "--world-size", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["errors"] == [] and report["warnings"] == []
    assert report["batch"] == {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 2}
    assert report["world_sizes"] == [4] and "config" not in report
    assert main(["validate", str(EXAMPLE), "--json", "--print-resolved"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_sizes"] == "any" and report["batch"] is None and report["config"]["bf16"]["enabled"] is True
    assert main(["validate", _write(tmp_path, IMPOSSIBLE), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and [e["path"] for e in report["errors"]] == ["train_batch_size"]
    assert main(["validate", str(tmp_path / "missing.json"), "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and "not found" in report["errors"][0]["message"]


IMPOSSIBLE = {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}


def test_batch_that_fits_no_world_size_is_an_error_without_world_size(tmp_path, capsys):
    assert main(["validate", _write(tmp_path, IMPOSSIBLE)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    for key in ("train_batch_size (30)", "train_micro_batch_size_per_gpu (4)", "gradient_accumulation_steps (2)"):
        assert key in err
    assert "fits no world size" in err
    assert "train_batch_size 24 (world size 3) or 32 (world size 4)" in err  # the nearest consistent values
    assert "leave out train_micro_batch_size_per_gpu (fits world size 1, 3, 5 or 15)" in err


@pytest.mark.parametrize(("keys", "expected"), [
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size 24 = micro 4 x GAS 2 x world size 3 (the only world size that fits)"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4},
     "train_batch_size 32 fits world size 1 (micro 4 x GAS 8), 2 (micro 4 x GAS 4), 4 (micro 4 x GAS 2), "
     "8 (micro 4 x GAS 1);"),
    ({"train_batch_size": 4096}, "(13 world sizes in all, up to 4096)"),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "micro 4 x GAS 2 x world size (8 per rank; any world size fits)"),
    ({"fp16": {"enabled": True}}, "no batch size given"),
])
def test_verdict_says_which_world_sizes_a_consistent_config_implies(tmp_path, capsys, keys, expected):
    assert main(["validate", _write(tmp_path, keys)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and expected in out


def test_invalid_config_exits_1_with_the_key_path(tmp_path, capsys):
    path = _write(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}})
    assert main(["validate", path]) == 1
    assert "zero_optimization.offload_param.device" in capsys.readouterr().err


def test_inconsistent_batch_exits_1(tmp_path, capsys):
    path = _write(tmp_path, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})
    assert main(["validate", path, "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "train_batch_size (10)" in err and "these values fit no world size" in err
    path = _write(tmp_path, {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 5,
                             "gradient_accumulation_steps": 2})
    assert main(["validate", path, "--world-size", "2"]) == 1
    assert "these values fit world size 3" in capsys.readouterr().err


HF_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"}}


def test_hf_auto_config_is_valid_with_a_note_naming_what_is_still_auto(tmp_path, capsys):
    assert main(["validate", _write(tmp_path, HF_AUTO)]) == 0
    captured = capsys.readouterr()
    assert 'batch sizes still "auto"' in captured.out and '6 value(s) still "auto"' in captured.out
    assert main(["validate", _write(tmp_path, HF_AUTO), "--print-resolved"]) == 0
    captured = capsys.readouterr()
    resolved = json.loads(captured.out)
    assert resolved["zero_optimization"]["prefetch_bucket_size"] == 50_000_000  # "auto" in a section: default
    assert 'note: 6 value(s) still "auto"' in captured.err
    assert "optimizer.params.lr" in captured.err and "gradient_clipping" in captured.err


def test_hf_auto_batch_with_world_size_names_every_key_and_hints(tmp_path, capsys):
    assert main(["validate", _write(tmp_path, HF_AUTO), "--world-size", "8"]) == 1
    err = capsys.readouterr().err
    assert "(3 problems)" in err and "gradient_accumulation_steps: is still" in err
    assert "leave out --world-size" in err


def test_bad_json_exits_1(tmp_path, capsys):
    assert main(["validate", _write(tmp_path, "{oops")]) == 1
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["validate"], ["frobnicate"], ["validate", "x.json", "--world-size", "two"],
                                  ["validate", "x.json", "--print-resolve-everything"]])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage: python -m ds_config" in capsys.readouterr().err


def test_unreadable_file_exits_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.json")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["validate", str(EXAMPLE), "--world-size", "0"]) == 2


def test_no_strict_warns_and_succeeds(tmp_path, capsys):
    path = _write(tmp_path, {"fp16": {"enabled": True, "futuristic_key": 1}})
    assert main(["validate", path]) == 1
    assert "fp16.futuristic_key: unknown key" in capsys.readouterr().err
    assert main(["validate", path, "--no-strict"]) == 0
    captured = capsys.readouterr()
    assert "fp16.futuristic_key" in captured.err and "1 warning(s)" in captured.out
    assert main(["validate", path, "--no-strict", "--json", "--print-resolved"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["fp16"]["enabled"] is True and "fp16.futuristic_key" in report["warnings"][0]


def test_schema_is_json_schema_with_the_sections(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["additionalProperties"] is False
    for section in ("train_batch_size", "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "aio",
                    "flops_profiler", "tensor_parallel", "expert_parallel", "sparse_attention", "wandb",
                    "compression_training", "data_efficiency", "elasticity", "autotuning", "compile"):
        assert section in schema["properties"], section
    assert "$defs" in schema and "DeepSpeedZeroConfig" in schema["$defs"]


def test_module_entry_point(tmp_path):
    # main()'s exit codes are tested in-process above; this checks the ``python -m`` wiring once (0 and 1).
    # The command of hatch.toml's validate-example script, from the repository root.
    ok = subprocess.run([sys.executable, "-m", "ds_config", "validate", "examples/ds_config.json", "--world-size", "1"],
                        capture_output=True, text=True, cwd=EXAMPLE.parents[1])
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == ("OK examples/ds_config.json: train_batch_size 8 = micro 4 x GAS 2 x world size 1; "
                         "0 warning(s)\n")
    bad = subprocess.run([sys.executable, "-m", "ds_config", "validate", _write(tmp_path, {"fp16": {"enabled": 1}})],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "fp16.enabled" in bad.stderr


def test_schema_accepts_real_configs_and_rejects_bad_ones():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(config_schema())
    hf = {"$schema": "./ds_config.schema.json", "train_batch_size": "auto", "gradient_clipping": "auto",
          "fp16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    for good in (json.loads(EXAMPLE.read_text()), hf, {"scheduler": {"type": "StepLR", "params": {"gamma": 0.5}}}):
        assert list(validator.iter_errors(good)) == []
    for bad in ({"bogus": 1}, {"fp16": {"enabled": 3}}, {"scheduler": {"type": "WarmupLR", "params": {"x": 1}}}):
        assert list(validator.iter_errors(bad))

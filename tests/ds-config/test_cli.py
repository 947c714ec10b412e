"""``python -m ds_config validate FILE [--world-size N] [--no-strict]`` and ``python -m ds_config schema``."""

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


def test_validate_prints_resolved_config(capsys):
    assert main(["validate", str(EXAMPLE), "--world-size", "2"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["train_batch_size"] == 16 and resolved["fp16"]["loss_scale_window"] == 1000
    assert resolved["zero_optimization"]["stage"] == 2


def test_invalid_config_exits_1_with_the_key_path(tmp_path, capsys):
    path = _write(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}})
    assert main(["validate", path]) == 1
    assert "zero_optimization.offload_param.device" in capsys.readouterr().err


def test_inconsistent_batch_exits_1(tmp_path, capsys):
    path = _write(tmp_path, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})
    assert main(["validate", path, "--world-size", "2"]) == 1
    assert "train_batch_size" in capsys.readouterr().err


HF_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"}}


def test_hf_auto_config_is_valid_with_a_note_naming_what_is_still_auto(tmp_path, capsys):
    assert main(["validate", _write(tmp_path, HF_AUTO)]) == 0
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


@pytest.mark.parametrize("argv", [[], ["validate"], ["frobnicate"], ["validate", "x.json", "--world-size", "two"]])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2


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
    assert "fp16.futuristic_key" in captured.err and json.loads(captured.out)["fp16"]["enabled"] is True


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
    ok = subprocess.run([sys.executable, "-m", "ds_config", "validate", str(EXAMPLE)], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["bf16"]["enabled"] is True
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

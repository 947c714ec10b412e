"""Every documented default of the top-level, precision, optimizer, scheduler and logging sections matches the
documents. The defaults are read from the spec at test time: the Markdown tables of the config reference, the
constructor signatures of the learning-rate schedules in the API reference, and the default blocks of the
text dump of the latest config page."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import pytest
from _spec_docs import require_spec

from ds_config import (
    AioConfig,
    AutotuningConfig,
    DeepSpeedConfig,
    ElasticityConfig,
    load_config,
    resolve_batch_sizes,
)
from ds_config.optimizer import PARAM_DEFAULTS
from ds_config.scheduler import SCHEDULER_PARAMS

# The parameters below are read from the spec at collection time: without it the module skips (fails in CI).
SPEC = require_spec("config-json-reference.md", "config-json-reference-early.md", "api-reference.txt",
                    "config-json-reference-latest.txt")

# Markdown heading -> where its keys live in the config ("" = top level); other headings belong to other
# sections' tests (zero, sparse attention) or have no scalar defaults (optimizer, scheduler).
HEADINGS = {
    "Batch Size Related Parameters": "", "Communication options": "", "Gradient Clipping": "", "Logging": "",
    "FP16 training options": "fp16", "Automatic mixed precision (AMP) training options": "amp",
    "Flops Profiler": "flops_profiler", "Activation Checkpointing": "activation_checkpointing",
}
NOT_LITERAL = {"train_micro_batch_size_per_gpu"}  # documented default: "train_batch_size value" (derived)


def _value(cell: str) -> Any:
    cell = cell.strip().strip("`").strip()
    lowered = cell.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    if cell.startswith('"') and cell.endswith('"'):
        return cell[1:-1]
    number = float(cell)
    return int(number) if number.is_integer() and "." not in cell else number


def markdown_defaults(name: str) -> list[tuple[str, Any]]:
    """(dotted key, documented default) from the key/Default tables of one Markdown page."""
    out, section, key, has_default = [], None, None, False
    for line in (SPEC / name).read_text().splitlines():
        if line.startswith("### "):
            section, key = HEADINGS.get(line[4:].strip()), None
            continue
        found = re.match(r"^(?:<i>\*\*|\*\*\*)([\w:\\ ]+?)(?:\*\*</i>|\*\*\*): \[", line)
        if found:
            key = found.group(1).replace("\\", "").strip()
            continue
        if section is None or key is None or not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[-1] in ("Default", "Example"):
            has_default = cells[-1] == "Default"
            continue
        if not has_default or "params" in key or key in NOT_LITERAL:
            continue
        parts = key.split(":")
        if len(parts) == 1 and section and key == section:  # the section's own row ("fp16": None)
            key = None
            continue
        dotted = ".".join(p for p in (section, *parts[-1:]) if p)
        out.append((dotted, _value(cells[-1])))
        key = None
    return out


def _lookup(config: DeepSpeedConfig, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


MD_DEFAULTS = markdown_defaults("config-json-reference.md")
EARLY_DEFAULTS = markdown_defaults("config-json-reference-early.md")


def test_tables_were_read():
    keys = {k for k, _ in MD_DEFAULTS}
    assert {"fp16.loss_scale", "steps_per_print", "flops_profiler.top_modules", "gradient_clipping",
            "activation_checkpointing.profile", "amp.enabled"} <= keys
    assert len(MD_DEFAULTS) >= 25


@pytest.mark.parametrize(("key", "default"), MD_DEFAULTS + EARLY_DEFAULTS, ids=lambda v: str(v))
def test_markdown_default(key: str, default: Any):
    config = DeepSpeedConfig()
    if key == "gradient_accumulation_steps":  # unset, it resolves to the documented 1
        assert resolve_batch_sizes(8, world_size=2).gradient_accumulation_steps == default
        return
    assert _lookup(config, key) == default


def _params_tables() -> list[tuple[str, str, Any]]:
    """(optimizer, param, default) from the '"params" key' tables that follow each optimizer example."""
    out, current, in_table = [], None, False
    for line in (SPEC / "config-json-reference.md").read_text().splitlines():
        kind = re.search(r'"type": "(\w+)"', line)
        if kind:
            current = kind.group(1).lower()
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == '"params" key':
            in_table = True
        elif in_table and current and not set(line) <= set("|- "):
            out.append((current, cells[0].replace("\\", ""), _value(cells[2])))
    return out


PARAM_ROWS = _params_tables()


def test_optimizer_param_tables_were_read():
    assert {o for o, _, _ in PARAM_ROWS} == {"adam", "onebitadam", "onebitlamb"}


@pytest.mark.parametrize(("optimizer", "param", "default"), PARAM_ROWS)
def test_optimizer_param_default(optimizer: str, param: str, default: Any):
    assert PARAM_DEFAULTS[optimizer][param] == default
    cfg = load_config({"optimizer": {"type": optimizer, "params": {"lr": 0.1}}})
    assert cfg.optimizer.constructor_params()[param] == default


def _schedule_signatures() -> dict[str, dict[str, Any]]:
    text = (SPEC / "api-reference.txt").read_text()
    out = {}
    for name, args in re.findall(r"class deepspeed\.runtime\.lr_schedules\.(\w+)\((.*?)\)\n", text, re.S):
        func = ast.parse(f"def f({' '.join(args.split())}): pass").body[0].args
        names = [a.arg for a in func.args]
        defaults = [ast.literal_eval(d) for d in func.defaults]
        required = names[: len(names) - len(defaults)]
        out[name] = {**{n: "<required>" for n in required if n != "optimizer"},
                     **dict(zip(names[len(required):], defaults, strict=True))}
    return out


SIGNATURES = _schedule_signatures()


def test_all_documented_schedules_are_modelled():
    assert set(SIGNATURES) == set(SCHEDULER_PARAMS) == {"LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
                                                        "WarmupCosineLR"}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_schedule_params_match_signature(name: str):
    model = SCHEDULER_PARAMS[name]
    assert set(model.model_fields) == set(SIGNATURES[name])
    for param, default in SIGNATURES[name].items():
        field = model.model_fields[param]
        if default == "<required>":
            assert field.is_required(), param
        else:
            assert field.default == default, param


def _dump_block(anchor: str) -> dict[str, Any]:
    """The contiguous '"key": value' lines around ``anchor`` in the latest page's text dump."""
    lines = (SPEC / "config-json-reference-latest.txt").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(anchor))
    start = at
    while start > 0 and re.match(r'^"\w+": [^{\[]*$', lines[start - 1]):
        start -= 1
    out = {}
    for line in lines[start:]:
        pair = re.match(r'^("\w+": [^{\[]*?),?$', line)
        if not pair:
            break
        out.update(json.loads("{" + pair.group(1) + "}"))
    return out


@pytest.mark.parametrize(("anchor", "model"), [('"results_dir"', AutotuningConfig), ('"block_size"', AioConfig)])
def test_default_blocks_of_latest_page(anchor: str, model: type):
    documented = _dump_block(anchor)
    assert len(documented) >= 5
    defaults = model()
    for key, value in documented.items():
        assert getattr(defaults, key) == value, key


def test_elasticity_defaults_documented_in_prose():
    text = (SPEC / "config-json-reference-latest.txt").read_text()
    cfg = ElasticityConfig()
    assert "[2,4,6]" in text and cfg.micro_batch_sizes == [2, 4, 6]
    assert re.search(r"max_gpus\n.*\n10000", text) and cfg.max_gpus == 10000
    assert cfg.min_gpus == 1 and cfg.min_time == 0 and cfg.version == 0.2 and cfg.prefer_larger_batch is True
    assert cfg.ignore_non_elastic_batch_info is False and cfg.num_gpus_per_node == 1


def test_autocast_default_module_list_matches_api_reference():
    text = (SPEC / "api-reference.txt").read_text()
    listed = re.search(r"DeepSpeed uses the default list: \[(.*?)\]", text).group(1)
    assert DeepSpeedConfig().torch_autocast.safe_modules == re.findall(r"`([\w.]+)`", listed)


def test_checkpoint_and_data_types_defaults_documented_in_prose():
    text = (SPEC / "config-json-reference-latest.txt").read_text()
    cfg = DeepSpeedConfig()
    assert re.search(r"consistent across all ranks.*\n“Warn”", text) and cfg.checkpoint.tag_validation == "Warn"
    assert re.search(r"shared filesystem\.\nfalse", text) and cfg.checkpoint.use_node_local_storage is False
    assert "If None the default is to match the model type" in text and cfg.data_types.grad_accum_dtype is None

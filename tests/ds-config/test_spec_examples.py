"""Every config example in the reference documents parses and validates.

The examples are extracted from the spec files at test time (never retyped): fenced code blocks in the
Markdown pages and the API reference (JSON blocks, plus ``ds_config = {...}`` dict literals in Python blocks),
and runs of JSON lines in the plain-text dump of the latest config page. Documentation placeholders are
normalised the way a reader would fill them in: ``[true|false]`` -> the first choice, ``...`` -> nothing,
``None`` -> ``null``, a bare placeholder name such as ``MODEL_PARALLEL_SIZE`` -> ``1``, a fragment
``"fp16": {...}`` -> wrapped into an object.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from dataclasses import dataclass

import pytest
from _ds_config_testing import schema_property_names
from _spec_docs import require_spec

from ds_config import (
    ConfigError,
    DeepSpeedConfig,
    DeepSpeedInferenceConfig,
    config_schema,
    load_config,
    validate_section,
)

CONFIG_DOCS = ("config-json-reference.md", "config-json-reference-early.md", "api-reference.txt")
TEXT_DUMP = "config-json-reference-latest.txt"
# The examples are parameters read at collection time: without the spec the module skips (fails in CI).
SPEC = require_spec(*CONFIG_DOCS, TEXT_DUMP)

@dataclass
class Example:
    where: str
    text: str

    @property
    def id(self) -> str:
        return self.where


# ----------------------------------------------------------------------------------------------- extraction
def _fenced_blocks(text: str) -> list[tuple[int, str]]:
    """(line, body) of every fenced block; a block split by a page break is joined again."""
    blocks: list[tuple[int, int, list[str]]] = []  # (first body line, closing fence line, body)
    lines, i = text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip().startswith("```"):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            between = [x.strip() for x in lines[blocks[-1][1] + 1:start - 1] if x.strip()] if blocks else []
            if between == ["(continues on next page)", "(continued from previous page)"] \
                    and not _balanced("\n".join(blocks[-1][2])):
                blocks[-1] = (blocks[-1][0], i, blocks[-1][2] + body)
            else:
                blocks.append((start, i, body))
        i += 1
    return [(start + 1, "\n".join(body)) for start, _, body in blocks]


def _balanced(body: str) -> bool:
    stripped = re.sub(r'"[^"]*"', "", body)
    return stripped.count("{") == stripped.count("}") and stripped.count("[") == stripped.count("]")


def _python_dicts(body: str) -> list[str] | None:
    """``name = {...}`` dict literals of a Python block, as JSON text (None when the block is not Python)."""
    try:
        tree = ast.parse(body.replace("...", "None"))
    except SyntaxError:
        return None
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            try:
                out.append(json.dumps(ast.literal_eval(node.value)))
            except ValueError:
                continue
    return out


def _looks_like_json(body: str) -> bool:
    head = body.strip()
    return head.startswith("{") or bool(re.match(r'^"\w+"\s*:', head))


def fenced_examples() -> list[Example]:
    out = []
    for name in CONFIG_DOCS:
        for line, body in _fenced_blocks((SPEC / name).read_text()):
            if _looks_like_json(body):
                out.append(Example(f"{name}:{line}", body))
            elif "= {" in body:
                for k, literal in enumerate(_python_dicts(body) or []):
                    out.append(Example(f"{name}:{line}#{k}", literal))
    return out


_JSON_LINE = re.compile(r'^\s*("[^"]*"\s*:|[{}\[\]]|"[^"]*",?$|-?\d[\d.eE+-]*,?$|(true|false|null),?$)')


def text_dump_runs() -> list[Example]:
    """Runs of JSON-looking lines in the latest page's text dump (which lost its code fences)."""
    lines = (SPEC / TEXT_DUMP).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if re.match(r'^"\w+"\s*:\s*\{\s*$', lines[i]) or lines[i].strip() == "{":
            j = i + 1
            while j < len(lines) and _JSON_LINE.match(lines[j]):
                j += 1
            if j - i > 1:
                out.append(Example(f"{TEXT_DUMP}:{i + 1}", "\n".join(lines[i:j])))
            i = j
        else:
            i += 1
    return out


# ----------------------------------------------------------------------------------------------- normalisation
def normalise(text: str) -> str:
    """Turn a documentation snippet into the JSON a reader would write."""
    text = re.sub(r'"\[([^\]|"]+)\|[^\]"]*\]"', r'"\1"', text)           # "[cpu|nvme]" -> "cpu"
    text = re.sub(r"\[([^\[\]|\"]+)\|[^\[\]\"]*\]", r"\1", text)          # [0|1|2|3] -> 0
    text = re.sub(r"^\s*\.\.\.\s*,?\s*$", "", text, flags=re.M)           # lines that are just ...
    text = text.replace("...", "")
    text = re.sub(r"\bNone\b", "null", text)
    text = re.sub(r"\bTrue\b", "true", re.sub(r"\bFalse\b", "false", text))
    text = re.sub(r"'([^'\n]*)'", r'"\1"', text)                           # ['a', 'b'] -> ["a", "b"]
    text = re.sub(r'(?<=[:\[,\s])(?!true\b|false\b|null\b|Infinity\b)([A-Za-z_][A-Za-z0-9_]*)(?=\s*[,\]}\n])',
                  "1", text)                                              # MODEL_PARALLEL_SIZE -> 1
    text = re.sub(r'([\d"\]}el])[ \t]*\n(\s*")', r"\1,\n\2", text)          # missing comma before a key
    text = re.sub(r",(\s*[}\]])", r"\1", text)                             # trailing commas
    if re.match(r'^\s*"', text):
        text = "{" + text + "}"
    return text


LOST_ITEMS = "<items lost in the text dump>"


def repair(text: str) -> str:
    """Rebuild brackets and commas a text dump dropped (best effort): a key inside an open list closes the
    list, consecutive entries get their comma, and whatever is still open at the end is closed."""
    out: list[str] = []
    stack: list[str] = []
    for line in text.splitlines():
        item = line.strip()
        if not item:
            continue
        if re.match(r'^"[^"]*"\s*:', item):
            if stack and stack[-1] == "]" and out[-1].endswith("["):
                out[-1] += '"' + LOST_ITEMS + '"'  # the dump dropped every item of this list
            while stack and stack[-1] == "]":
                out[-1] += "]"
                stack.pop()
        if out and not out[-1].endswith((",", "{", "[")) and not item.startswith(("}", "]")):
            out[-1] += ","
        for ch in re.sub(r'"[^"]*"', "", item):
            if ch in "{[":
                stack.append("}" if ch == "{" else "]")
            elif ch in "}]" and stack:
                stack.pop()
        out.append(item)
    return re.sub(r",\s*$", "", "\n".join(out)) + "".join(reversed(stack))


def parse(example: Example, dump: bool = False) -> dict:
    return json.loads(normalise(repair(example.text) if dump else example.text))


# Where a fragment of a section lives: the examples of "offload_param" etc. show only the sub-section.
_ZERO3 = {"stage": 3}
FRAGMENT_HOMES = {
    "offload_param": lambda d: {"zero_optimization": {**_ZERO3, **d}},
    "offload_optimizer": lambda d: {"zero_optimization": {**_ZERO3, **d}},
    "patterns": lambda d: {"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [d]}}},
}


def in_context(data: dict) -> dict:
    """Place a fragment of a nested section where it belongs in a whole config."""
    for key, home in FRAGMENT_HOMES.items():
        if key in data:
            return home(data)
    return data


def _validate(data: dict) -> object:
    data = in_context(data)
    inference_keys = set(DeepSpeedInferenceConfig.known_keys())
    if set(data) <= inference_keys and not set(data) <= set(DeepSpeedConfig.known_keys()):
        return validate_section(DeepSpeedInferenceConfig, data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated names in old examples warn; that is tested elsewhere
        return load_config(data)


FENCED = fenced_examples()
DUMP = text_dump_runs()


def test_examples_were_found():
    # Counts the extractor finds in the spec as shipped; a big drop means the extraction broke.
    assert len(FENCED) >= 30, [e.where for e in FENCED]
    assert len(DUMP) >= 10


@pytest.mark.parametrize("example", FENCED, ids=lambda e: e.id)
def test_fenced_example_parses_and_validates(example: Example):
    _validate(parse(example))


USER_NAMED = ("different_groups", "curriculum_metrics")  # children of these are names the user picks


def _documented_keys() -> set[str]:
    """Every key used in an example (except user-chosen names) and every key with a Markdown table."""
    keys: set[str] = set()

    def walk(node: object, parent: str = "") -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if parent not in USER_NAMED:
                    keys.add(key)
                walk(value, key)
        elif isinstance(node, list):
            for value in node:
                walk(value, parent)

    for example in FENCED:
        walk(parse(example))
    for example in DUMP:  # only runs that survived the dump intact: damaged ones misplace keys
        data = parse(example, dump=True)
        try:
            _validate(data)
        except ConfigError:
            continue
        walk(data)
    for name in ("config-json-reference.md", "config-json-reference-early.md"):
        for found in re.findall(r"(?:<i>\*\*|\*\*\*)([\w:\\]+?)(?:\*\*</i>|\*\*\*): \[", (SPEC / name).read_text()):
            keys.add(found.replace("\\", "").split(":")[-1])
    return keys


def test_every_documented_key_is_known():
    documented = _documented_keys()
    assert len(documented) > 120
    assert sorted(documented - SCHEMA_KEYS) == []


SCHEMA_KEYS = schema_property_names(config_schema(), DeepSpeedInferenceConfig.model_json_schema())


def dump_damage(example: Example, data: dict, err: ConfigError) -> str | None:
    """Why a text-dump example cannot validate although its source can: the dump dropped lines, so keys
    lost their nesting (each unknown key is a documented key of another section) or lists lost their items."""
    if LOST_ITEMS in json.dumps(data):
        return "the text dump dropped the items of a list"
    unknown = [p for p in err.problems if "unknown key" in p.message or "Extra inputs" in p.message]
    leaves = [p.path.split(".")[-1] for p in unknown]
    # Besides the misplaced keys themselves, only their consequences may fail (the section they left is
    # now missing them, e.g. "different_groups is empty").
    consequences = [p for p in err.problems if p not in unknown]
    if unknown and all(leaf in SCHEMA_KEYS for leaf in leaves) and all(
            p.path.split(".")[-1] in leaves for p in consequences):
        return f"the text dump dropped closing lines, so {', '.join(leaves)} lost their nesting"
    return None


def _dump_cases() -> list:
    cases = []
    for example in DUMP:
        try:
            data = parse(example, dump=True)
        except json.JSONDecodeError as exc:
            cases.append(pytest.param(example, None, id=example.id, marks=pytest.mark.skip(
                reason=f"text dump lost lines of this example, not JSON even after repair: {exc.msg}")))
            continue
        cases.append(pytest.param(example, data, id=example.id))
    return cases


@pytest.mark.parametrize(("example", "data"), _dump_cases())
def test_text_dump_example_validates(example: Example, data: dict):
    try:
        _validate(data)
    except ConfigError as err:
        reason = dump_damage(example, data, err)
        if reason is None:
            raise
        pytest.xfail(f"{reason}: {err}")


def summary() -> dict[str, int]:
    """Numbers for the report: ``python tests/ds-config/test_spec_examples.py``."""
    ok = bad = 0
    for example in FENCED:
        try:
            _validate(parse(example))
            ok += 1
        except (ValueError, ConfigError) as exc:
            bad += 1
            print("FAIL", example.where, str(exc)[:300])
    recovered = valid = 0
    for example in DUMP:
        try:
            data = parse(example, dump=True)
        except json.JSONDecodeError:
            continue
        recovered += 1
        try:
            _validate(data)
            valid += 1
        except ConfigError as exc:
            damage = dump_damage(example, data, exc)
            print("DAMAGED" if damage else "FAIL", example.where, damage or str(exc)[:300])
    return {"fenced_found": len(FENCED), "fenced_valid": ok, "fenced_failed": bad, "dump_runs": len(DUMP),
            "dump_recovered": recovered, "dump_valid": valid}


if __name__ == "__main__":
    print(summary())

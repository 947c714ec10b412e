"""Every field the API reference documents for the zero, inference and monitor config classes exists here with
its documented default and alias, and no undocumented field was added.

The table is read from ../shared/spec/api-reference.txt itself (lines such as
``prefetch_bucket_size: `int = 50,000,000` (alias `'stage3_prefetch_bucket_size'`)``), not retyped.
"""

from __future__ import annotations

import ast
import re
import sys

import pytest
from _spec_docs import require_spec
from pydantic import BaseModel

from ds_config import inference, monitor, zero

# <repository root>/../shared/spec or $DS_SPEC_DIR; without it the module skips (fails in CI).
SPEC = require_spec("api-reference.txt") / "api-reference.txt"

_HEAD = re.compile(r"^`?class `?deepspeed\.(?:runtime\.zero\.config|inference\.config|monitor\.config)\.(\w+)`?\s*$")
_STOP = re.compile(r"^(`?class |Example|\d+(\.\d+)+ |INDICES)")
_FIELD = re.compile(r"^(\w+): `?(.+?) = (.+?)`?(?: \(alias `?'(\w+)'`?\))?`?\s*$")
_FACTORY = re.compile(r"^(\w+): `(\w+) \[Optional\]`\s*$")


def _documented() -> dict[str, list[tuple[str, str, str, str | None]]]:
    """class name -> [(field, type, default text, alias)] in documented order."""
    blocks: dict[str, list] = {}
    current = None
    for raw in SPEC.read_text().splitlines():
        line = raw.strip()
        if head := _HEAD.match(line):
            current = blocks.setdefault(head.group(1), [])
        elif current is not None and _STOP.match(line):
            current = None
        elif current is not None and (f := _FIELD.match(line)):
            current.append(f.groups())
        elif current is not None and (f := _FACTORY.match(line)):
            current.append((f.group(1), f.group(2), "[Optional]", None))
    return blocks


DOC = _documented()
CLASSES = {
    "DeepSpeedZeroConfig": zero.DeepSpeedZeroConfig,
    "DeepSpeedZeroOffloadParamConfig": zero.DeepSpeedZeroOffloadParamConfig,
    "DeepSpeedZeroOffloadOptimizerConfig": zero.DeepSpeedZeroOffloadOptimizerConfig,
    "DeepSpeedInferenceConfig": inference.DeepSpeedInferenceConfig,
    "DeepSpeedTPConfig": inference.DeepSpeedTPConfig,
    "DeepSpeedMoEConfig": inference.DeepSpeedMoEConfig,
    "QuantizationConfig": inference.QuantizationConfig,
    "InferenceCheckpointConfig": inference.InferenceCheckpointConfig,
    "TensorBoardConfig": monitor.TensorBoardConfig,
    "WandbConfig": monitor.WandbConfig,
    "CometConfig": monitor.CometConfig,
    "CSVConfig": monitor.CSVConfig,
}
# Fields whose documented default is "unset" and that validation resolves from other fields.
RESOLVED = {("DeepSpeedZeroConfig", "overlap_comm"): False}
ROWS = [(cls, *row) for cls, rows in DOC.items() for row in rows]


def test_every_documented_class_is_parsed_and_modelled():
    assert set(DOC) == set(CLASSES)
    counts = {name: len(rows) for name, rows in DOC.items()}
    assert counts["DeepSpeedZeroConfig"] == 44 and counts["DeepSpeedInferenceConfig"] == 32
    assert sum(counts.values()) == 129


# Read by DeepSpeed 0.19.8's parser, after the documented list (issue 26: keys DeepSpeed reads are not unknown).
LATER = {"DeepSpeedZeroConfig": ["compute_grad_norm", "parameter_alignment"]}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_fields_match_documentation_exactly(name):
    assert list(CLASSES[name].model_fields) == [row[0] for row in DOC[name]] + LATER.get(name, [])


@pytest.mark.parametrize("cls_name,field,doc_type,doc_default,alias", ROWS,
                         ids=[f"{r[0]}.{r[1]}" for r in ROWS])
def test_documented_default_and_alias(cls_name, field, doc_type, doc_default, alias):
    cls = CLASSES[cls_name]
    info = cls.model_fields[field]
    assert info.alias == alias
    value = getattr(cls(), field)
    if (cls_name, field) in RESOLVED:
        assert info.default is None and doc_default == "None"
        assert value == RESOLVED[(cls_name, field)]
        return
    _assert_matches(value, doc_type, doc_default)


def _assert_matches(value, doc_type: str, text: str) -> None:
    if text == "{}" or text == "[Optional]":
        assert isinstance(value, BaseModel) and type(value).__name__ in doc_type
        assert value == type(value)()
    elif text == "sys.maxsize":
        assert value == sys.maxsize
    elif text.startswith("torch."):
        assert value == inference.DtypeEnum.parse(text)
    elif re.fullmatch(r"\w+Enum\.\w+", text):
        assert type(value).__name__ == text.split(".")[0] and value.name == text.split(".")[1]
    elif call := re.fullmatch(r"(\w+)\((.*)\)", text):
        assert type(value).__name__ == call.group(1)
        node = ast.parse(text, mode="eval").body
        expected = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        assert value.model_dump() == expected
    else:
        expected = ast.literal_eval(text.replace(",", "") if re.fullmatch(r"-?[\d,]+(\.\d+)?", text) else text)
        assert value == expected and (isinstance(value, bool) == isinstance(expected, bool))


def test_default_instances_validate_their_own_dumps():
    for cls in CLASSES.values():
        dumped = cls().model_dump(mode="json")
        assert cls.model_validate(dumped).model_dump(mode="json") == dumped


def test_offload_state_enum_has_the_documented_members():
    documented = set(re.findall(r"`OffloadStateTypeEnum\.(\w+)`", SPEC.read_text()))
    assert documented and documented == {m.name for m in zero.OffloadStateTypeEnum}


def test_enums_accept_their_documented_values():
    assert [int(s) for s in zero.ZeroStageEnum] == [0, 1, 2, 3] and zero.ZeroStageEnum.max_stage == 3
    assert {d.value for d in zero.OffloadDeviceEnum} == {"none", "cpu", "nvme"}
    assert {t.value for t in inference.MoETypeEnum} == {"standard", "residual"}

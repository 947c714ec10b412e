"""``ds_config.config_utils`` (served as ``deepspeed.runtime.config_utils``): DeepSpeed's config-model base with its
deprecated-field protocol, and the small helpers; plus the ``DeepSpeedFP16Config`` methods of ``FP16Config``."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from enum import Enum

import pytest
from pydantic import Field, ValidationError

from ds_config import FP16Config
from ds_config._base import DeprecatedConfigWarning
from ds_config.config_utils import (
    DeepSpeedConfigModel,
    DeepSpeedConfigObject,
    ScientificNotationEncoder,
    dict_raise_error_on_duplicate_keys,
    get_config_default,
    get_dict_param,
    get_list_param,
    get_scalar_param,
    pp_int,
)


class Color(str, Enum):
    red = "red"
    blue = "blue"


class Inner(DeepSpeedConfigModel):
    size: int = 1


class Example(DeepSpeedConfigModel):
    """A third-party config in DeepSpeed's style (e.g. DeepSpeed-MII's)."""

    new_value: int = 0
    old_value: str = Field("0", json_schema_extra={"deprecated": True, "new_param": "new_value",
                                                   "new_param_fn": lambda v: int(v) * 10})
    inner: Inner = Field(default_factory=Inner)
    old_size: int | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "inner.size"})
    old_note: bool | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "new_value",
                                                           "set_new_param": False, "deprecated_msg": "no effect"})
    color: Color = Color.red


def test_deprecated_field_moves_to_its_replacement_with_a_warning():
    with pytest.warns(DeprecatedConfigWarning, match="old_value is deprecated use new_value instead"):
        cfg = Example(old_value="3")
    assert cfg.new_value == 30  # new_param_fn applied
    assert cfg.old_value == "0" and "old_value" not in cfg.model_fields_set  # the value has moved


def test_deprecated_field_into_a_nested_model():
    with pytest.warns(DeprecatedConfigWarning, match="use inner.size instead"):
        cfg = Example(old_size=7)
    assert cfg.inner.size == 7


def test_deprecated_field_that_only_warns():
    with pytest.warns(DeprecatedConfigWarning, match="old_note is deprecated use new_value instead. no effect"):
        cfg = Example(old_note=True)
    assert cfg.old_note is True and cfg.new_value == 0


def test_deprecated_and_replacement_together_is_an_error():
    with pytest.raises(ValueError, match="Cannot provide deprecated parameter 'old_value' and replacing"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecatedConfigWarning)
            Example(old_value="3", new_value=1)


def test_deprecated_and_replacement_together_is_also_deepspeeds_assertion_error():
    # DeepSpeed asserts here, and its callers (its own unit tests among them) catch AssertionError
    with pytest.raises(AssertionError, match="'old_size' and replacing parameter 'inner.size' together"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecatedConfigWarning)
            Example(old_size=3, inner={"size": 2})


def test_auto_means_the_default_and_unknown_keys_are_rejected():
    assert Example(new_value="auto").new_value == 0
    assert Example(strict=True, new_value="auto", inner={"size": "auto"}).inner.size == 1
    with pytest.raises(ValidationError, match="did you mean 'new_value'"):
        Example(new_valeu=1)


def test_model_config_is_deepspeeds():
    cfg = Example(color="blue")
    assert cfg.color == "blue" and not isinstance(cfg.color, Color)  # use_enum_values
    with pytest.raises(ValidationError):
        cfg.new_value = "not a number"  # validate_assignment
    assert get_config_default(Example, "new_value") == 0 and get_config_default(cfg, "inner") == Inner()
    with pytest.raises(ValueError, match="not a field"):
        get_config_default(Example, "missing")


def test_pp_int_prints_for_documentation():
    assert repr(pp_int(1e5)) == "100,000" and pp_int(1e5) == 100_000
    assert repr(pp_int(sys.maxsize, "sys.maxsize")) == "sys.maxsize"


def test_scientific_notation_encoder():
    text = json.dumps({"bucket": 5e8, "lr": 0.001, "ok": True, "steps": [1, 2000], "nested": {"n": 3}},
                      cls=ScientificNotationEncoder)
    assert '"bucket": 5.000000e+08' in text and '"lr": 0.001' in text and '"ok": true' in text
    assert '"steps": [1, 2.000000e+03]' in text and '"n": 3' in text

    class Obj(DeepSpeedConfigObject):
        def __init__(self):
            self.b, self.a = 1e9, "x"

    assert json.loads(repr(Obj()).replace("1.000000e+09", "1e9")) == {"a": "x", "b": 1e9}


def test_param_getters_and_duplicate_keys():
    d = {"a": 1, "b": [2], "c": {"d": 3}}
    assert get_scalar_param(d, "a", 0) == 1 and get_scalar_param(d, "z", 9) == 9
    assert get_list_param(d, "b", []) == [2] and get_dict_param(d, "c", {}) == {"d": 3}
    assert json.loads('{"a": 1, "b": 2}', object_pairs_hook=dict_raise_error_on_duplicate_keys) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['a'\]"):
        json.loads('{"a": 1, "b": 2, "a": 3}', object_pairs_hook=dict_raise_error_on_duplicate_keys)


def test_fp16_section_has_deepspeeds_loss_scale_methods():
    fp16 = FP16Config(enabled=True, initial_scale_power=12, loss_scale_window=500, hysteresis=3, min_loss_scale=2)
    assert fp16.initial_dynamic_scale() == 4096
    assert fp16.dynamic_loss_scale_args() == {"init_scale": 4096, "scale_window": 500, "delayed_shift": 3,
                                              "consecutive_hysteresis": False, "min_scale": 2}


def test_config_utils_does_not_import_torch():
    code = "import sys, ds_config.config_utils; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

"""The shared machinery: errors with key paths, did-you-mean, "auto", deprecated names, strict=False."""

from __future__ import annotations

import pickle
import warnings
from typing import Annotated, Literal

import pytest
from pydantic import AliasChoices, Field, model_validator

from ds_config import ConfigError, ConfigProblem, DeprecatedConfigWarning, UnknownConfigKeyWarning, validate_section
from ds_config._base import Deprecated, DSConfigModel, KeepAuto, keeps_auto
from ds_config._errors import did_you_mean, join_path


class Inner(DSConfigModel):
    size: int = 5
    mode: Literal["a", "b"] = "a"


class Outer(DSConfigModel):
    inner: Inner = Field(default_factory=Inner)
    items: list[Inner] = []
    lr: Annotated[float | Literal["auto"], KeepAuto()] = 0.1
    maybe: Annotated[int | Literal["auto"], KeepAuto()] | None = None
    new_name: int = 1
    old_name: Annotated[int | None, Deprecated(new="new_name", convert=lambda v: v * 2)] = None
    threads: int = Field(1, validation_alias=AliasChoices("threads", "intra_op_parallelism"))

    @model_validator(mode="after")
    def _cross(self) -> Outer:
        if self.inner.size == 13:
            raise ConfigError(ConfigProblem("inner.size", "13 is unlucky", 13))
        return self


def test_join_path_and_did_you_mean():
    assert join_path("a", "b", 0, "c") == "a.b[0].c"
    assert join_path("", None, "x") == "x"
    assert did_you_mean("stag", ["stage", "other"]) == " (did you mean 'stage'?)"
    assert did_you_mean("zzzz", ["stage"]) == ""
    assert did_you_mean("STAGE", ["stage"]) == " (did you mean 'stage'?)"


def test_config_error_is_a_value_error_listing_every_problem():
    err = ConfigError([ConfigProblem("a.b", "bad", 3), ConfigProblem("c", "missing")])
    assert isinstance(err, ValueError)
    assert err.paths == ["a.b", "c"]
    assert "a.b: bad (got 3)" in str(err) and "c: missing" in str(err) and "2 problems" in str(err)


def test_config_error_pickles_with_its_problems_and_class():
    # a rank's error crosses a process boundary (multiprocessing pools, DeepSpeed's test launcher) by pickling
    from ds_config.elasticity import ElasticityConfigError

    for err in (ConfigError([ConfigProblem("a.b", "bad", 3), ConfigProblem("c", "is required but missing")]),
                ElasticityConfigError("Elasticity config missing micro_batch_sizes")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.paths == err.paths
        assert [p.value for p in back.problems][:1] == [p.value for p in err.problems][:1]


def test_unknown_key_at_depth_names_full_path_and_suggestion():
    with pytest.raises(ConfigError) as err:
        validate_section(Outer, {"items": [{}, {"sise": 3}]}, path="root")
    assert err.value.paths == ["root.items[1].sise"]
    assert "did you mean 'size'" in str(err.value)


def test_wrong_value_names_path_value_and_accepted():
    with pytest.raises(ConfigError) as err:
        validate_section(Outer, {"inner": {"mode": "c"}})
    problem = err.value.problems[0]
    assert problem.path == "inner.mode" and problem.value == "c" and "'a' or 'b'" in problem.message


def test_strict_false_warns_and_drops_unknown_keys():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = validate_section(Outer, {"inner": {"bogus": 1, "size": 7}, "top": 2}, strict=False)
    assert model.inner.size == 7
    assert sorted(str(w.message) for w in caught) == ["ignoring unknown config key 'inner.bogus'",
                                                      "ignoring unknown config key 'top'"]


def test_strict_false_still_fails_on_wrong_values():
    with pytest.warns(UnknownConfigKeyWarning), pytest.raises(ConfigError) as err:
        validate_section(Outer, {"bogus": 1, "inner": {"size": "x"}}, strict=False)
    assert err.value.paths == ["inner.size"]


def test_auto_means_default_unless_kept():
    model = validate_section(Outer, {"inner": {"size": "auto"}, "lr": "auto", "maybe": "auto"})
    assert model.inner.size == 5 and model.lr == "auto" and model.maybe == "auto"
    assert keeps_auto(Outer.model_fields["maybe"]) and not keeps_auto(Outer.model_fields["new_name"])


def test_deprecated_name_warns_and_moves_its_value():
    with pytest.warns(DeprecatedConfigWarning, match="use 'new_name'"):
        model = validate_section(Outer, {"old_name": 4})
    assert model.new_name == 8


def test_deprecated_and_new_name_together_is_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as err:
            validate_section(Outer, {"old_name": 4, "new_name": 1})
    assert "give only 'new_name'" in str(err.value)


def test_alias_choices_are_known_keys():
    assert validate_section(Outer, {"intra_op_parallelism": 3}).threads == 3
    assert {"threads", "intra_op_parallelism"} <= set(Outer.known_keys())


def test_assignment_is_validated_but_not_rescreened():
    with pytest.warns(DeprecatedConfigWarning):
        model = validate_section(Outer, {"old_name": 4})
    model.lr = 0.5  # the state still holds old_name; assignment must not treat it as new input
    assert model.lr == 0.5 and model.new_name == 8
    with pytest.raises(ValueError):
        model.inner.mode = "z"


def test_config_error_raised_in_a_validator_keeps_its_paths():
    with pytest.raises(ConfigError) as err:
        validate_section(Outer, {"inner": {"size": 13}}, path="top")
    assert err.value.paths == ["top.inner.size"] and err.value.problems[0].value == 13


def test_unknown_key_does_not_hide_other_problems():
    from ds_config import DeepSpeedConfig
    from ds_config._base import validate_section

    bad = {"optimzer": {}, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    with pytest.raises(ConfigError) as info:
        validate_section(DeepSpeedConfig, bad)
    assert set(info.value.paths) == {"optimzer", "zero_optimization.offload_param.device"}
    assert "did you mean 'optimizer'" in str(info.value)


@pytest.mark.parametrize(("data", "expected"), [
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "x"}}},
     "scheduler.params.warmup_max_lr: must be a number, a list or 'auto' (got 'x')"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled: must be a boolean (true or false) (got 'yes')"),
    ({"zero_optimization": 3}, "zero_optimization: must be an object (a JSON {...} section) (got 3)"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device: must be 'none', 'cpu' or 'nvme' (got 'gpu')"),
    ({"train_batch_size": 1.5}, "train_batch_size: must be a whole number (not fractional) or 'auto' (got 1.5)"),
])
def test_type_errors_read_as_one_sentence_of_what_is_accepted(data, expected):
    # pydantic's per-branch wording ("Input should be ... or Input should be ...") folded into one sentence
    from ds_config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(data)
    assert [str(p) for p in err.value.problems] == [expected]
    assert "Input should" not in str(err.value)


def test_suggestion_of_a_deprecated_name_points_to_its_replacement():
    from ds_config import load_config

    with pytest.raises(ConfigError) as err:
        load_config({"zero_optimization": {"stage": 3, "cpu_offload_params": True}, "bfloat_16": {}})
    messages = {p.path: p.message for p in err.value.problems}
    assert messages["zero_optimization.cpu_offload_params"] == (
        "unknown key (did you mean 'cpu_offload_param'? It is deprecated: use 'offload_param')")
    assert messages["bfloat_16"] == "unknown key (did you mean 'bfloat16'? It is deprecated: use 'bf16')"


def test_strict_false_warning_keeps_the_did_you_mean():
    from ds_config import load_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"zero_optimization": {"stage": 2, "overlap_com": True}}, strict=False)
    assert cfg.zero_stage == 2
    assert [str(w.message) for w in caught] == [
        "ignoring unknown config key 'zero_optimization.overlap_com' (did you mean 'overlap_comm'?)"]

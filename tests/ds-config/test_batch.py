"""Batch arithmetic: train_batch_size = micro batch per GPU x gradient accumulation steps x world size."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds_config import BatchSizes, ConfigError, load_config, resolve_batch_sizes
from ds_config.batch import implied_world_sizes


@pytest.mark.parametrize(("given_keys", "world", "expected"), [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 4, (16, 4, 1)),
])
def test_derives_the_missing_keys(given_keys, world, expected):
    sizes = resolve_batch_sizes(**given_keys, world_size=world)
    assert (sizes.train_batch_size, sizes.train_micro_batch_size_per_gpu, sizes.gradient_accumulation_steps) \
        == expected
    assert sizes.world_size == world


def test_inconsistent_values_show_the_equation():
    with pytest.raises(ConfigError) as err:
        resolve_batch_sizes(30, 4, 2, world_size=4)
    text = str(err.value)
    assert "train_batch_size (30)" in text and "(4)" in text and "(2)" in text and "= 32" in text
    assert err.value.paths == ["train_batch_size"]


def test_non_divisible_derivation_names_the_derived_key():
    with pytest.raises(ConfigError) as err:
        resolve_batch_sizes(30, 4, world_size=4)
    assert err.value.paths == ["gradient_accumulation_steps"] and "1.875" in str(err.value)
    with pytest.raises(ConfigError) as err:
        resolve_batch_sizes(30, world_size=4)
    assert err.value.paths == ["train_micro_batch_size_per_gpu"]


@pytest.mark.parametrize("bad", [
    {"gradient_accumulation_steps": 2},  # neither the global nor the micro batch
    {},
    {"train_batch_size": 0},
    {"train_batch_size": True},
    {"train_batch_size": "auto"},
])
def test_bad_inputs(bad):
    with pytest.raises(ConfigError):
        resolve_batch_sizes(**bad, world_size=2)


@pytest.mark.parametrize("world", [0, -1, 1.5])
def test_bad_world_size(world):
    with pytest.raises(ConfigError) as err:
        resolve_batch_sizes(8, world_size=world)
    assert err.value.paths == ["world_size"]


@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 32),
       st.sampled_from(["tbs+mbs", "tbs+gas", "mbs+gas", "all"]))
def test_any_two_keys_reproduce_the_third(mbs, gas, world, which):
    tbs = mbs * gas * world
    keys = {"tbs+mbs": (tbs, mbs, None), "tbs+gas": (tbs, None, gas), "mbs+gas": (None, mbs, gas),
            "all": (tbs, mbs, gas)}[which]
    assert resolve_batch_sizes(*keys, world_size=world) == BatchSizes(tbs, mbs, gas, world)


# ---- before the world size is known: which world sizes do the given keys fit? ----
_maybe = st.one_of(st.none(), st.integers(1, 24))


@given(st.integers(1, 240), _maybe, _maybe)
def test_implied_world_sizes_are_exactly_those_resolve_accepts(tbs, mbs, gas):
    accepted = []
    for world in range(1, tbs + 2):
        try:
            resolve_batch_sizes(tbs, mbs, gas, world_size=world)
        except ConfigError:
            continue
        accepted.append(world)
    try:
        implied = implied_world_sizes(tbs, mbs, gas)
    except ConfigError as err:
        assert accepted == []
        assert "fits no world size" in str(err) and "nearest consistent: train_batch_size" in str(err)
        return
    assert list(implied) == accepted and accepted  # an empty fit is an error, never an empty answer


@given(st.integers(1, 24), _maybe, st.integers(1, 64))
def test_without_train_batch_size_every_world_size_fits(mbs, gas, world):
    assert implied_world_sizes(None, mbs, gas) is None
    assert resolve_batch_sizes(None, mbs, gas, world_size=world).train_batch_size == mbs * (gas or 1) * world


@given(st.integers(1, 500), st.integers(1, 16), st.integers(1, 16))
def test_suggested_nearest_values_fit_the_world_sizes_they_name(tbs, mbs, gas):
    if tbs % (mbs * gas) == 0:
        assert implied_world_sizes(tbs, mbs, gas) == (tbs // (mbs * gas),)
        return
    with pytest.raises(ConfigError) as err:
        implied_world_sizes(tbs, mbs, gas)
    text = str(err.value)
    assert err.value.paths == ["train_batch_size"] and f"train_batch_size ({tbs})" in text
    assert f"train_micro_batch_size_per_gpu ({mbs})" in text and f"gradient_accumulation_steps ({gas})" in text
    suggestions = re.findall(r"(\d+) \(world size (\d+)\)", text.split("nearest consistent:")[1].split(";")[0])
    assert suggestions, text
    for value, world in suggestions:
        assert abs(int(value) - tbs) < mbs * gas  # the multiples of micro x GAS on either side
        assert resolve_batch_sizes(int(value), mbs, gas, world_size=int(world)).train_batch_size == int(value)


def test_impossible_triple_names_the_nearest_options():
    with pytest.raises(ConfigError) as err:
        implied_world_sizes(30, 4, 2)
    text = str(err.value)
    assert "30 / 8 = 3.75" in text and "train_batch_size 24 (world size 3) or 32 (world size 4)" in text
    assert "leave out train_micro_batch_size_per_gpu (fits world size 1, 3, 5 or 15)" in text
    assert "leave out gradient_accumulation_steps" not in text  # 30 is not a multiple of the micro batch 4
    assert implied_world_sizes(32, 4) == (1, 2, 4, 8) and implied_world_sizes(12) == (1, 2, 3, 4, 6, 12)
    with pytest.raises(ConfigError, match="either train_batch_size or train_micro_batch_size_per_gpu"):
        implied_world_sizes(None, None, 4)


def test_error_at_one_world_size_names_the_world_sizes_that_fit():
    with pytest.raises(ConfigError, match="these values fit world size 3$"):
        resolve_batch_sizes(30, 5, 2, world_size=2)
    with pytest.raises(ConfigError, match="these values fit world size 1, 3, 5 or 15$"):
        resolve_batch_sizes(30, None, 2, world_size=2)


def test_config_exposes_derived_numbers_after_world_size():
    cfg = load_config({"train_batch_size": 64, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError):
        _ = cfg.batch
    sizes = cfg.resolve_batch(8)
    assert cfg.batch is sizes and cfg.train_micro_batch_size_per_gpu == 4
    assert cfg.to_dict()["train_micro_batch_size_per_gpu"] == 4
    assert load_config({"train_micro_batch_size_per_gpu": 2}, world_size=3).batch.train_batch_size == 6


def test_world_size_at_load_checks_consistency():
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                     "gradient_accumulation_steps": 1}, world_size=2)
    assert "train_batch_size (10)" in str(err.value)


def test_auto_batch_sizes_block_resolution_by_name():
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(ConfigError) as err:
        cfg.resolve_batch(2)
    assert "train_batch_size" in err.value.paths[0] and "auto" in str(err.value)


def test_every_auto_batch_key_and_bad_value_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        resolve_batch_sizes("auto", "auto", 0, world_size=8)
    assert err.value.paths == ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
    assert "Hugging Face" in str(err.value) and "write a number" in str(err.value)
    assert "(got 0)" in str(err.value.problems[2])

"""Checks that were stricter than DeepSpeed's now match it (issue 26), or are deliberate (docs/deviations.md):
Hjson config files, PLD's theta/gamma, compression techniques without groups, stage-3 offload options below
stage 3."""

from __future__ import annotations

import warnings

import pytest

from ds_config import ConfigError, load_config

HJSON = """// DeepSpeed reads config files with hjson: comments, unquoted keys, optional commas
{
  train_batch_size: 8   # the global batch
  fp16: {
    enabled: true
  }
  optimizer: {
    type: Adam
    params: {lr: 1e-3, betas: [0.9, 0.99,],}
  }
}
"""


def test_hjson_config_file_reads_as_deepspeed_reads_it(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(HJSON)
    cfg = load_config(str(path))
    assert (cfg.train_batch_size, cfg.fp16.enabled, cfg.optimizer.type) == (8, True, "Adam")
    assert cfg.optimizer.params.lr == 1e-3 and list(cfg.optimizer.params.betas) == [0.9, 0.99]


def test_hjson_file_still_rejects_duplicate_keys_and_unknown_keys(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text("{\n train_batch_size: 8\n train_batch_size: 4\n}")
    with pytest.raises(ConfigError, match="train_batch_size: is given twice"):
        load_config(str(path))
    path.write_text("{\n train_batch_size: 8\n fp61: {enabled: true}\n}")
    with pytest.raises(ConfigError, match=r"fp61: unknown key \(did you mean 'fp16'\?\)"):
        load_config(str(path))


def test_text_that_is_neither_json_nor_hjson_names_both(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true}')  # unclosed
    with pytest.raises(ConfigError, match=r"is not valid JSON: .* \(nor valid Hjson\)"):
        load_config(str(path))


@pytest.mark.parametrize(("theta", "gamma"), [(0.0, 0.001), (1.0, 0.0), (0.5, 0.01)])
def test_pld_theta_and_gamma_accept_what_deepspeeds_schedule_accepts(theta, gamma):
    cfg = load_config({"train_batch_size": 4,
                       "progressive_layer_drop": {"enabled": True, "theta": theta, "gamma": gamma}})
    assert (cfg.progressive_layer_drop.theta, cfg.progressive_layer_drop.gamma) == (theta, gamma)


def test_pld_theta_above_one_stays_an_error():  # deliberate: a keep probability above 1
    with pytest.raises(ConfigError, match="progressive_layer_drop.theta"):
        load_config({"train_batch_size": 4, "progressive_layer_drop": {"enabled": True, "theta": 1.5}})


def _technique(**section) -> dict:
    return {"train_batch_size": 4, "compression_training": {"row_pruning": {
        "shared_parameters": {"enabled": True, "method": "l1"}, **section}}}


def test_enabled_technique_without_different_groups_is_an_error_as_in_deepspeed():
    with pytest.raises(ConfigError, match="row_pruning.different_groups: the technique is enabled, so "
                                          "different_groups must be given"):
        load_config(_technique())


def test_enabled_technique_with_empty_groups_is_accepted_with_a_warning():
    with pytest.warns(UserWarning, match="RowPruningConfig is enabled with an empty different_groups"):
        cfg = load_config(_technique(different_groups={}))
    assert cfg.compression_training.row_pruning.different_groups == {}


def test_disabled_technique_needs_no_groups():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"train_batch_size": 4, "compression_training": {"row_pruning": {
            "shared_parameters": {"enabled": False}}}})

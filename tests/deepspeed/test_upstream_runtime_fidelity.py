"""DeepSpeed behaviours its own unit tests rely on: ``DeepSpeedConfig._configure_train_batch_size``, the
activation-checkpointing config read back from an engine's resolved ``config`` dict, and
``runtime.utils.count_used_parameters_in_backward``."""

from __future__ import annotations

import pytest
import torch

from deepspeed.runtime.activation_checkpointing.config import activation_checkpointing_section
from deepspeed.runtime.config import BatchConfigError, DeepSpeedConfig
from deepspeed.runtime.utils import count_used_parameters_in_backward


def _reconfigure(config: DeepSpeedConfig, tbs: int | None, mbs: int | None, gas: int | None) -> None:
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = tbs, mbs, gas
    config._configure_train_batch_size()


def test_configure_train_batch_size_derives_from_the_attributes_as_they_are_now():
    config = DeepSpeedConfig({"train_batch_size": 8})
    config.world_size = 2
    _reconfigure(config, 32, None, 2)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
        == (32, 8, 2)
    _reconfigure(config, None, 4, None)
    assert (config.train_batch_size, config.gradient_accumulation_steps) == (8, 1)


@pytest.mark.parametrize("tbs, mbs, gas", [(33, 17, 2), (32, 18, 1), (None, None, 2)])
def test_configure_train_batch_size_refuses_with_deepspeeds_assertion_error(tbs, mbs, gas):
    config = DeepSpeedConfig({"train_batch_size": 8})
    config.world_size = 2
    with pytest.raises(AssertionError) as info:
        _reconfigure(config, tbs, mbs, gas)
    assert isinstance(info.value, BatchConfigError) and isinstance(info.value, ValueError)
    assert "train_" in str(info.value)  # names the keys


def test_activation_checkpointing_reads_a_dict_resolved_for_another_world_size():
    # an engine's ``config`` dict holds all three batch keys resolved for its data-parallel size (2 here); read
    # back in a process whose world size differs, the section must not fail the batch arithmetic
    resolved = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                "activation_checkpointing": {"partition_activations": True, "number_checkpoints": 3}}
    section = activation_checkpointing_section(resolved)
    assert section.partition_activations is True and section.number_checkpoints == 3
    with pytest.raises(ValueError, match="activation_checkpointing.partition_activatoins"):
        activation_checkpointing_section({**resolved, "activation_checkpointing": {"partition_activatoins": True}})


def test_count_used_parameters_in_backward_counts_the_parameters_this_backward_reaches():
    used, unused, frozen = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    frozen.requires_grad_(False)
    seen = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(count_used_parameters_in_backward([used, unused, frozen, used]))
        return grad

    used.register_hook(hook)
    (used * frozen).sum().backward()
    assert seen == [1]
    with pytest.raises(RuntimeError, match="while a backward pass runs"):
        count_used_parameters_in_backward([used])


def test_initialize_without_a_model_raises_deepspeeds_assertion_error_too():
    import deepspeed

    with pytest.raises(AssertionError, match="model is required") as info:
        deepspeed.initialize(torch.nn.Linear(2, 2), config={"train_batch_size": 1})  # positional: that is `args`
    assert isinstance(info.value, ValueError)


def _grad_accum_mix(stage: int) -> str:
    import warnings

    import deepspeed
    from ds_config import ConfigError, InertConfigKeyWarning

    config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": "bf16"}}
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    except NotImplementedError as exc:
        return f"refused (ConfigError: {isinstance(exc, ConfigError)})"
    return "inert" if any(issubclass(w.category, InertConfigKeyWarning) for w in seen) else "silent"


@pytest.mark.parametrize(("stage", "outcome"), [(0, "refused (ConfigError: True)"), (1, "inert")])
def test_grad_accum_dtype_off_the_precision_as_deepspeed_treats_it(stage, outcome):
    # DeepSpeed: ZeRO ignores the mix (gradients reduce in the training dtype); without ZeRO NotImplementedError
    from _harness import run_distributed

    assert run_distributed(_grad_accum_mix, world_size=1, args=(stage,), timeout=90)[0] == outcome

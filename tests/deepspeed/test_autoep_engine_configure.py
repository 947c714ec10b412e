"""AutoEP is configured by the engine (``DeepSpeedEngine._configure_expert_parallel``), as in DeepSpeed: an engine
built directly (no ``deepspeed.initialize``) replaces the MoE blocks, points the client optimizer at the new expert
tensors and takes the sequence-parallel size from its mpu; ``deepspeed.runtime.autoep``'s checks run before any
group exists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from deepspeed.runtime.autoep import AutoEPRun, check_expert_parallel, configure_expert_parallel
from ds_moe.autoep import AutoEPConfig

transformers = pytest.importorskip("transformers")


def _mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(config)


def _engine(extra: dict, optimizer_of=None):
    from deepspeed.runtime.engine import DeepSpeedEngine
    from ds_config import load_config

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
           "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}, **extra}
    if optimizer_of is None:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
    config = load_config(cfg)
    config.resolve_batch(dist.get_world_size() // config.sequence_parallel_size)
    model = _mixtral()
    optimizer = optimizer_of(model) if optimizer_of is not None else None
    return DeepSpeedEngine(model, config, optimizer=optimizer), optimizer


def _direct_engine() -> tuple[int, bool, bool, int]:
    engine, client = _engine({}, optimizer_of=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    layers = [m for m in engine.module.modules() if type(m).__name__ == "AutoEPMoELayer"]
    owned = {id(p) for p in engine.module.parameters()}
    in_client = all(id(p) in owned for group in client.param_groups for p in group["params"])
    ids = [id(p) for p in engine.module.parameters()]
    engine._configure_expert_parallel(engine.module)  # again: nothing left to replace, groups kept
    again = [id(p) for p in engine.module.parameters()] == ids
    ids_ = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(input_ids=ids_, labels=ids_).loss)
    engine.step()
    return len(layers), in_client, again, dist.get_world_size(layers[0].ep_group)


def test_engine_built_directly_configures_autoep():
    for replaced, in_client, again, ep_world in run_distributed(_direct_engine, world_size=2, timeout=120):
        assert replaced == 2 and ep_world == 2
        assert in_client, "the client optimizer still holds the replaced experts' tensors"
        assert again, "a second _configure_expert_parallel changed the model"


def _sequence_parallel_data_first() -> str:
    import deepspeed
    from deepspeed.utils import groups

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "sequence_parallel_size": 2, "use_data_before_expert_parallelism": True,
           "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}}
    try:
        deepspeed.initialize(model=_mixtral(), config=cfg)  # the sequence mpu is initialize's
    except ValueError as err:
        return str(err)
    finally:
        groups.register_mpu(None)  # the worker process is reused by later tests
    return "no error"


def test_sequence_parallel_size_from_the_mpu_reaches_the_expert_groups():
    # the sequence ranks are DeepSpeed's "sp" model-parallel mode of the expert layout, which has no
    # data-before-expert rank order: refused, where a layout without the sequence size would have been built
    for message in run_distributed(_sequence_parallel_data_first, world_size=2, timeout=120):
        assert "use_data_before_expert_parallel_=True with mp_size=2" in message


class _MegatronTensorParallel:
    def get_tensor_model_parallel_world_size(self) -> int:
        return 2


def test_client_mpu_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="bwc_tensor_model_parallel_world_size=2"):
        check_expert_parallel(AutoEPRun(AutoEPConfig(enabled=True, autoep_size=2), mpu=_MegatronTensorParallel()),
                              world=4)


def test_deepcompile_with_folding_is_refused_before_any_group():
    run = AutoEPRun(AutoEPConfig(enabled=True, autoep_size=2), tp_size=2, deepcompile=True)
    with pytest.raises(ValueError, match=r"DeepCompile with AutoEP\+AutoTP folding is not supported"):
        check_expert_parallel(run, world=4)  # needs no process group: nothing collective ran


def test_single_process_without_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="expert_parallel.autoep_size=2 needs torch.distributed"):
        configure_expert_parallel(_mixtral(), AutoEPRun(AutoEPConfig(enabled=True, autoep_size=2)))
    model = _mixtral()
    assert configure_expert_parallel(model, AutoEPRun(AutoEPConfig(enabled=True, autoep_size=1,
                                                                   preset_model="mixtral"))) is None
    assert sum(type(m).__name__ == "AutoEPMoELayer" for m in model.modules()) == 2

"""``engine.load_module_state_dict``: DeepSpeed's hook for loading a checkpoint's module weights.

Real engines throughout: the strict/allowance/custom-function semantics, the ZeRO-3 gathered load (rank 0's
values become every rank's), and ``load_checkpoint`` calling a subclass's override (plain and ZeRO-3, 2 ranks).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

_ADAM = {"type": "Adam", "params": {"lr": 0.05}}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _config(stage: int) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    # threshold 0: every weight is partitioned (the default keeps these small ones whole on every rank)
    return {"train_batch_size": 2 * dist.get_world_size(), "optimizer": _ADAM, "zero_optimization": zero}


def _build(engine_class, stage: int, seed: int = 0):
    """An engine of ``engine_class`` built the way ``deepspeed.initialize`` builds one (a client subclass)."""
    from ds_config import load_config

    config = load_config(_config(stage), world_size=dist.get_world_size())
    config.resolve_batch(dist.get_world_size())
    return engine_class(_model(seed), config)


def _full_weights(engine) -> dict[str, torch.Tensor]:
    from deepspeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _train_step(engine) -> None:
    x = torch.randn(2, 6)
    engine.backward(engine(x).pow(2).mean())
    engine.step()


# ---- semantics on one rank ------------------------------------------------------------------------------------
def _semantics_body() -> dict:
    import deepspeed

    engine = deepspeed.initialize(model=_model(0), config=_config(0))[0]
    target = {k: v + 1.0 for k, v in _model(1).state_dict().items()}
    out = {}
    engine.load_module_state_dict({"module": target})
    out["strict_loaded"] = all(torch.equal(engine.module.state_dict()[k], v) for k, v in target.items())

    partial = {k: v * 3 for k, v in target.items() if k != "2.bias"}
    engine.load_module_state_dict({"module": partial}, allowed_missing_keys=["2.bias"])
    out["allowance_loaded"] = torch.equal(engine.module[0].weight, partial["0.weight"])
    out["allowance_kept"] = torch.equal(engine.module[2].bias, target["2.bias"])

    no_first = {k: v for k, v in partial.items() if k != "0.weight"}
    with pytest.raises(RuntimeError, match=r"outside AutoEP expert.*missing=\['0.weight'\]"):
        engine.load_module_state_dict({"module": no_first}, allowed_missing_keys=["2.bias"])
    with pytest.raises(RuntimeError, match=r"outside AutoEP expert.*unexpected=\['extra'\]"):
        engine.load_module_state_dict({"module": {**target, "extra": torch.zeros(1)}},
                                      allowed_missing_keys=["2.bias"])
    with pytest.raises(RuntimeError, match="Missing key"):  # strict without an allowance: torch's own error
        engine.load_module_state_dict({"module": no_first})
    # strict=False stays non-strict whatever the allowance
    engine.load_module_state_dict({"module": {"extra": torch.zeros(1), "0.bias": target["0.bias"] * 0}},
                                  strict=False, allowed_missing_keys=["2.bias"])
    out["nonstrict_loaded"] = bool((engine.module[0].bias == 0).all())

    seen = []
    engine.load_module_state_dict({"module": target}, custom_load_fn=lambda src, dst: seen.append((src, dst)))
    out["custom_called"] = len(seen) == 1 and seen[0][0] is target and seen[0][1] is engine.module
    with pytest.raises(TypeError, match="'module' entry"):
        engine.load_module_state_dict(target)
    return out


def test_strict_allowance_and_custom_load_fn():
    out = run_distributed(_semantics_body, world_size=1, timeout=60)[0]
    assert out == {"strict_loaded": True, "allowance_loaded": True, "allowance_kept": True,
                   "nonstrict_loaded": True, "custom_called": True}


def test_pipeline_engine_takes_the_same_keywords():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    ours = inspect.signature(PipelineEngine.load_module_state_dict).parameters
    base = inspect.signature(DeepSpeedEngine.load_module_state_dict).parameters
    assert list(ours) == list(base) == ["self", "checkpoint", "strict", "custom_load_fn", "fetch_z3_params",
                                        "z3_params_to_fetch", "allowed_missing_keys"]


# ---- ZeRO-3: gathered for the load, rank 0's values win -------------------------------------------------------
def _zero3_gathered_body() -> dict:
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = _build(DeepSpeedEngine, stage=3)
    partitioned = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
    # each rank offers different values: with fetch_z3_params, rank 0's become everyone's (modifier rank 0)
    offered = {k: torch.full_like(v, float(dist.get_rank() + 2)) for k, v in _model(0).state_dict().items()}
    engine.load_module_state_dict({"module": offered}, fetch_z3_params=True)
    after = _full_weights(engine)
    first = engine.module[0].weight
    engine.load_module_state_dict({"module": {k: v * 5 for k, v in offered.items()}},
                                  z3_params_to_fetch=[first])
    only_first = _full_weights(engine)
    _train_step(engine)  # the partitions and masters agree with what was loaded: training goes on from there
    return {"partitioned": len(partitioned), "all_rank0": all(bool((v == 2).all()) for v in after.values()),
            "released_after": all(p.ds_status.name == "NOT_AVAILABLE" for p in partitioned),
            "first_from_rank0": bool((only_first["0.weight"] == 10).all()),
            "moved": not torch.equal(_full_weights(engine)["0.weight"], only_first["0.weight"])}


def test_zero3_load_gathers_and_takes_rank0_values():
    outs = run_distributed(_zero3_gathered_body, world_size=2, timeout=90)
    for out in outs:
        assert out["partitioned"] == 4 and out["all_rank0"] and out["released_after"]
        assert out["first_from_rank0"] and out["moved"]


# ---- load_checkpoint goes through the override ----------------------------------------------------------------
def _override_body(save_dir: str, stage: int) -> dict:
    from deepspeed.runtime.engine import DeepSpeedEngine

    class RecordingEngine(DeepSpeedEngine):
        calls: list = []

        def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False,
                                   z3_params_to_fetch=None, allowed_missing_keys=None):
            RecordingEngine.calls.append((sorted(checkpoint), strict))
            super().load_module_state_dict(checkpoint, strict=strict, custom_load_fn=custom_load_fn,
                                           fetch_z3_params=stage == 3)

    engine = _build(RecordingEngine, stage=stage)
    _train_step(engine)
    saved = _full_weights(engine)
    engine.save_checkpoint(save_dir, tag="t")
    _train_step(engine)
    changed = not torch.equal(_full_weights(engine)["0.weight"], saved["0.weight"])
    path, client = engine.load_checkpoint(save_dir, tag="t", load_module_strict=False)
    restored = _full_weights(engine)
    return {"changed": changed, "loaded": path is not None, "calls": RecordingEngine.calls,
            "restored": all(torch.equal(restored[k], v) for k, v in saved.items()),
            "steps": engine.global_steps}


@pytest.mark.parametrize("stage", [0, 3])
def test_load_checkpoint_calls_a_subclass_override(tmp_path, stage):
    outs = run_distributed(_override_body, world_size=2, args=(str(tmp_path), stage), timeout=120)
    for out in outs:
        assert out["changed"] and out["loaded"] and out["restored"] and out["steps"] == 1
        assert len(out["calls"]) == 1
        keys, strict = out["calls"][0]
        assert "module" in keys and "global_steps" in keys and strict is False


# ---- the sequence-parallel size AutoEP's ZeRO-3 checks use ----------------------------------------------------
def _sequence_size_body() -> dict:
    from types import SimpleNamespace

    import deepspeed

    engine = deepspeed.initialize(model=_model(0), config=_config(0))[0]
    without = engine._autoep_sequence_parallel_world_size()  # no mpu: deepspeed.utils.groups' size
    engine.mpu = SimpleNamespace(get_sequence_parallel_world_size=lambda: 4)
    return {"without": without, "mpu": engine._autoep_sequence_parallel_world_size()}


def test_autoep_sequence_parallel_world_size():
    assert run_distributed(_sequence_size_body, world_size=1, timeout=60)[0] == {"without": 1, "mpu": 4}

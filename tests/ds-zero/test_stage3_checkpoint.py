"""ZeRO-3 checkpoints: DeepSpeed's stage-3 layout (per-rank model-states files with no weights, per-rank optimizer
files with the flat fp32 partitions), an exact resume on CPU fp32, a resume on another data-parallel world size
(2 -> 1 and 2 -> 4) without conversion, ``zero_to_fp32`` on our files, frozen parameters, and a checkpoint that
does not fit the model (an error naming the parameter, nothing loaded)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from _zero3_toy import GLOBAL, TiedNet
from _zero3_toy import train_step as _step

ZERO = {"stage": 3, "stage3_param_persistence_threshold": 20, "reduce_bucket_size": 100}


def _config(world: int, zero: dict | None = None) -> dict:
    return {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // world,
            "gradient_clipping": 0.5, "steps_per_print": 10**6, "zero_optimization": zero or ZERO,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}


def _whole(engine) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters(remove_duplicate=False)}


def _engine(seed: int, zero: dict | None = None):
    import deepspeed

    torch.manual_seed(seed)
    return deepspeed.initialize(model=TiedNet(scale=0.5), config=_config(dist.get_world_size(), zero))[0]


def _save_then_continue(save_dir: str) -> dict:
    engine = _engine(0)
    for step in range(3):
        _step(engine, step)
    engine.save_checkpoint(save_dir, tag="t3")
    saved = _whole(engine)
    losses = [_step(engine, step) for step in range(3, 6)]
    return {"saved": saved, "losses": losses, "final": _whole(engine), "files": sorted(os.listdir(
        os.path.join(save_dir, "t3")))}


def _load_then_continue(save_dir: str, zero: dict | None = None) -> dict:
    engine = _engine(7, zero)  # other initial weights: a load that does nothing shows
    path, _ = engine.load_checkpoint(save_dir)
    loaded, steps = _whole(engine), engine.global_steps
    losses = [_step(engine, step) for step in range(3, 6)]
    return {"path": path, "loaded": loaded, "losses": losses, "final": _whole(engine),
            "steps": steps, "lr": engine.get_lr()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict]]:
    save_dir = str(tmp_path_factory.mktemp("z3ckpt"))
    return save_dir, run_distributed(_save_then_continue, world_size=2, args=(save_dir,), timeout=90)


def test_layout_is_deepspeeds_stage3(saved):
    save_dir, results = saved
    assert results[0]["files"] == ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                   "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                   "zero_pp_rank_1_mp_rank_00_model_states.pt",
                                   "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    model = torch.load(os.path.join(save_dir, "t3", "zero_pp_rank_1_mp_rank_00_model_states.pt"), weights_only=True)
    assert {k: tuple(v.shape) for k, v in model["module"].items()} == {
        "scale": (), **{k: (0,) for k in ("inp.weight", "inp.bias", "frozen.weight", "frozen.bias", "mid.weight",
                                          "mid.bias", "back.weight", "head.weight", "head.bias")}}
    assert list(model["param_shapes"][0]) == ["inp.weight", "inp.bias", "mid.weight", "mid.bias", "head.weight",
                                              "head.bias"]
    assert model["frozen_param_fragments"]["frozen.weight"].shape == (72,)
    assert model["shared_params"] == {"back.weight": "mid.weight"}
    # DeepSpeed's ZeRO-3 load takes its loss scaler object from the file (as DeepSpeed's own files hold one)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler]):
        optim = torch.load(os.path.join(save_dir, "t3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                           weights_only=True)
    sd = optim["optimizer_state_dict"]
    assert sd["zero_stage"] == 3 and sd["partition_count"] == 2
    # every key DeepSpeed's ZeRO-3 load reads without a default
    assert type(sd["loss_scaler"]) is LossScaler and sd["loss_scaler"].cur_scale == 1.0
    assert sd["dynamic_loss_scale"] is False and sd["overflow"] is False
    assert {"state", "param_groups"} <= set(sd["optimizer_state_dict"]) and "ds_version" in optim
    # 36 + 6 + 72 + 6 + 18 + 2: every parameter's ceil(numel / 2) slice, back to back
    assert [t.shape for t in sd["fp32_flat_groups"]] == [(140,)]


def test_zero_to_fp32_reads_our_stage3_checkpoint(saved):
    from ds_zero.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    save_dir, results = saved
    got = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t3")
    want = {**results[0]["saved"], "scale": torch.tensor(0.5)}  # buffers come from the model-states file
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("world", [2, 1, 4])
def test_resume_exact_and_on_another_world_size(saved, world):
    save_dir, before = saved
    after = run_distributed(_load_then_continue, world_size=world, args=(save_dir,), timeout=90)
    for rank, r in enumerate(after):  # its own model-states file, or rank 0's when the save had fewer ranks
        assert r["path"].endswith(f"zero_pp_rank_{rank if rank < 2 else 0}_mp_rank_00_model_states.pt")
        for name, value in before[0]["saved"].items():
            assert torch.equal(r["loaded"][name], value), name  # the weights come back bit for bit
        assert r["steps"] == 3
    if world == 2:  # the same layout: the continuation is bitwise the one that never stopped
        assert after[0]["losses"] == before[0]["losses"]
        for name, value in before[0]["final"].items():
            assert torch.equal(after[0]["final"][name], value), name
    else:  # another split of the same global batch: the same training up to summation order
        assert after[0]["losses"] == pytest.approx(before[0]["losses"], rel=1e-5)
        for name, value in before[0]["final"].items():
            assert float((after[0]["final"][name] - value).norm()) <= 1e-5 * float(value.norm()), name


def test_resume_with_other_sub_groups(saved):
    """The saved partitions are one flat group per rank; the loading engine cuts its groups into sub-groups of
    about 30 elements (and 4 ranks): matched by parameter name."""
    save_dir, before = saved
    after = run_distributed(_load_then_continue, world_size=4, args=(save_dir, {**ZERO, "sub_group_size": 30}),
                            timeout=90)
    for name, value in before[0]["saved"].items():
        assert torch.equal(after[0]["loaded"][name], value), name
    assert after[0]["losses"] == pytest.approx(before[0]["losses"], rel=1e-5)


def _load_wrong_model(save_dir: str) -> str:
    import deepspeed

    torch.manual_seed(0)
    engine = deepspeed.initialize(model=TiedNet(hidden=10, scale=0.5), config=_config(dist.get_world_size()))[0]
    before = _whole(engine)
    try:
        engine.load_checkpoint(save_dir)
    except Exception as exc:  # noqa: BLE001 - the message is the point
        unchanged = all(torch.equal(v, before[k]) for k, v in _whole(engine).items())
        return f"{type(exc).__name__}: {exc} | unchanged={unchanged}"
    return "no error"


def test_checkpoint_of_another_model_is_a_clear_error(saved):
    save_dir, _ = saved
    for message in run_distributed(_load_wrong_model, world_size=2, args=(save_dir,), timeout=90):
        assert "inp.weight" in message or "frozen.weight" in message, message
        assert "unchanged=True" in message, message

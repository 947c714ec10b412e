"""AutoTP training checkpoints loaded at another tensor-parallel size (2 gloo ranks, a tiny Llama).

The model states hold the full weights, so TP 2 -> 1 and TP 1 -> 2 load them (each rank cuts its shard) and give
the saved model's outputs, then train. Optimizer states are not re-sharded by a plain load: asking for them across
TP sizes is a clear error raised before anything is loaded (ZeRO-0 keeps them in the model states, ZeRO-1 in its
own files) that points at the Universal Checkpoint, through which a resume at another TP size is exact.
"""

from __future__ import annotations

import pytest
import torch
from _autotp_models import tiny, without_tp_plan
from _harness import run_distributed

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}


def _engine(tp: int, stage: int, universal: bool = False, kind: str = "llama"):
    import deepspeed

    model = without_tp_plan(tiny(kind).train())  # AutoTP heuristics: embedding and projections sharded
    config = {**BASE, "zero_optimization": {"stage": stage}}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return deepspeed.initialize(model=model, config=config)[0]


def _loss(engine, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return engine(input_ids=tokens, labels=tokens, use_cache=False).loss.item()


def _full(engine) -> dict[str, torch.Tensor]:
    from ds_inference.autotp import full_state_dict, tp_layers

    sd = full_state_dict(engine.module) if tp_layers(engine.module) else engine.module.state_dict()
    return {k: v.clone() for k, v in sd.items()}


def _resize(save_dir: str, tp_from: int, tp_to: int, stage: int) -> dict:
    """Save at ``tp_from`` after one step, load at ``tp_to``: first with optimizer states (refused, nothing
    changed), then without (same outputs and full weights, counters restored), then one more training step."""
    from deepspeed.runtime.checkpointing import CheckpointError

    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    saved = _engine(tp_from, stage)
    saved.backward(saved(input_ids=tokens, labels=tokens, use_cache=False).loss)
    saved.step()
    saved.save_checkpoint(save_dir, tag="t")
    want_loss, want_weights = _loss(saved, tokens), _full(saved)

    loaded = _engine(tp_to, stage)
    before = _full(loaded)
    with pytest.raises(CheckpointError) as refused:
        loaded.load_checkpoint(save_dir, tag="t")
    untouched = all(torch.equal(before[k], v) for k, v in _full(loaded).items()) and loaded.global_steps == 0
    path, _ = loaded.load_checkpoint(save_dir, tag="t", load_optimizer_states=False)
    got_weights = _full(loaded)
    differ = [k for k, v in want_weights.items() if not torch.allclose(got_weights[k], v, atol=1e-6)]
    loss = _loss(loaded, tokens)
    loaded.backward(loaded(input_ids=tokens, labels=tokens, use_cache=False).loss)
    loaded.step()
    trained = _loss(loaded, tokens)
    loaded.load_checkpoint(save_dir, tag="t", load_module_only=True)  # the weights alone, at the new size too
    back = _full(loaded)
    module_only = all(torch.allclose(back[k], v, atol=1e-6) for k, v in want_weights.items())
    return {"module_only": module_only and loaded.global_steps == 2,
            "error": str(refused.value), "untouched": untouched, "path": path, "differ": differ,
            "loss": loss, "want_loss": want_loss, "after_step": trained,
            "steps": loaded.global_steps, "tp": loaded.mp_world_size}


@pytest.mark.parametrize(("tp_from", "tp_to", "stage"), [(2, 1, 0), (1, 2, 1)])
def test_autotp_checkpoint_loads_at_another_tp_size(tmp_path, tp_from, tp_to, stage):
    results = run_distributed(_resize, world_size=2, args=(str(tmp_path), tp_from, tp_to, stage), timeout=120)
    for rank, r in enumerate(results):
        # optimizer states across TP sizes: refused on every rank, naming both sizes and the way out
        assert f"autotp_size={tp_from}" in r["error"] and f"autotp_size={tp_to}" in r["error"], r["error"]
        assert "load_optimizer_states=False" in r["error"]
        assert "ds_to_universal" in r["error"] and "load_universal" in r["error"], r["error"]  # the exact way
        assert r["untouched"], f"rank {rank}: the refused load changed the model or the counters"
        # every rank read a full-weight file (TP 1 wrote only mp_rank_00) and holds the saved model
        assert r["path"].endswith("mp_rank_00_model_states.pt")
        assert r["differ"] == []
        assert r["tp"] == tp_to
        assert r["loss"] == pytest.approx(r["want_loss"], abs=1e-5)
        # it trains on from the loaded weights: the step counter goes on and the loss on the batch falls
        assert r["steps"] == 2
        assert r["after_step"] < r["loss"]
        assert r["module_only"], f"rank {rank}: load_module_only did not restore the saved weights alone"


def test_a_non_autotp_model_parallel_layout_is_refused():
    """An AutoTP file (full weights) is not loaded by an engine whose model parallelism is not AutoTP's (an
    ``mpu`` whose files hold per-rank shards), and vice versa; same-size AutoTP loads are not checked."""
    from deepspeed.runtime.checkpointing import CheckpointError, EngineState, ParallelInfo
    from deepspeed.runtime.checkpointing.tp_resize import check_tp_resize

    class AutoTP:
        owns_optimizer_state, autotp_size = False, 2

    mpu = EngineState(module=torch.nn.Linear(2, 2), parallel=ParallelInfo(mp_rank=1, mp_world_size=2))
    with pytest.raises(CheckpointError, match="model-parallel size 2 .AutoTP size 2., loading with model-parallel "
                                               "size 2 .AutoTP size None."):
        check_tp_resize(mpu, {"autotp_size": 2, "mp_world_size": 2}, "f.pt", True, False)
    check_tp_resize(mpu, {"mp_world_size": 2}, "f.pt", True, False)  # neither side AutoTP: not this check's call
    tp = EngineState(module=torch.nn.Linear(2, 2), parallel=ParallelInfo(mp_world_size=2), shards=(AutoTP(),))
    with pytest.raises(CheckpointError, match="AutoTP size None"):
        check_tp_resize(tp, {"mp_world_size": 4}, "f.pt", False, True)
    check_tp_resize(tp, {"autotp_size": 2, "mp_world_size": 2}, "f.pt", True, False)


def _train_step(engine, tokens: torch.Tensor) -> None:
    engine.backward(engine(input_ids=tokens, labels=tokens, use_cache=False).loss)
    engine.step()


def _universal_resume(save_dir: str, tp_from: int, tp_to: int, stage: int, kind: str, probe: str) -> dict:
    """Train one step at ``tp_from``, save, convert with ``ds_to_universal`` (rank 0), train on uninterrupted;
    a ``tp_to`` engine loads the universal checkpoint and takes the same next step."""
    import os

    import torch.distributed as dist

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    first = _engine(tp_from, stage, kind=kind)
    _train_step(first, tokens)
    first.save_checkpoint(save_dir, tag="t")
    if dist.get_rank() == 0:
        ds_to_universal(["--input_folder", os.path.join(save_dir, "t"),
                         "--output_folder", os.path.join(save_dir, "t_universal"), "--inject_missing_state"])
    dist.barrier()
    _train_step(first, tokens)
    want, want_weights = _loss(first, tokens), _full(first)

    resumed = _engine(tp_to, stage, universal=True, kind=kind)
    resumed.load_checkpoint(save_dir)  # the tag from latest_universal
    _train_step(resumed, tokens)
    got_weights = _full(resumed)
    worst = max((got_weights[k] - v).abs().max().item() for k, v in want_weights.items())
    saved = torch.load(os.path.join(save_dir, "t_universal", "zero", probe, "exp_avg.pt"), weights_only=True)
    return {"loss": _loss(resumed, tokens), "want": want, "worst": worst, "steps": resumed.global_steps,
            "tp": resumed.mp_world_size, "exp_avg_shape": tuple(saved["param"].shape),
            "full_shape": tuple(want_weights[probe].shape)}


@pytest.mark.parametrize(("tp_from", "tp_to", "stage", "kind", "probe"), [
    (2, 1, 1, "gpt2", "transformer.h.0.attn.c_attn.weight"),  # fused QKV (Conv1D): pieces per sub-parameter
    (1, 2, 2, "llama", "model.layers.0.self_attn.q_proj.weight"),
    (2, 1, 0, "llama", "model.layers.0.mlp.up_proj.weight"),  # no ZeRO: the moments from the model states
])
def test_autotp_resume_through_a_universal_checkpoint_is_exact(tmp_path, tp_from, tp_to, stage, kind, probe):
    """Values and Adam moments are put back together from the TP shards (and cut again at load): the step after
    the resume at another TP size matches the uninterrupted run."""
    results = run_distributed(_universal_resume, world_size=2,
                              args=(str(tmp_path), tp_from, tp_to, stage, kind, probe), timeout=120)
    for rank, r in enumerate(results):
        assert r["tp"] == tp_to and r["steps"] == 2
        assert r["exp_avg_shape"] == r["full_shape"], "the universal moments are not the full parameter's"
        # two uninterrupted runs at TP 1 and TP 2 already differ by ~2e-5 in the weights (summation order)
        assert r["worst"] < 1e-4, f"rank {rank}: weights differ by {r['worst']} after the resumed step"
        assert r["loss"] == pytest.approx(r["want"], abs=1e-5), (r["loss"], r["want"])


def test_assemble_puts_fused_pieces_back():
    """Two ranks holding Q/K/V pieces each: the shards go back to their ranges of the full dimension."""
    from deepspeed.checkpoint.autotp_universal import assemble
    from ds_inference.autotp.sharding import ShardMeta, make_layout

    layout = make_layout([4, 2, 2], ShardMeta(tp_size=2, tp_grain_size=1), by_heads=False)
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    shards = [layout.take(full, r, 0) for r in range(2)]
    saved = {"dim": 0, "full": layout.full, "pieces": [list(map(list, p)) for p in layout.pieces]}
    assert torch.equal(assemble(shards, saved), full)
    assert torch.equal(assemble(shards, None), shards[0])

"""Universal Checkpoints of pipeline-parallel runs: a tiny GPT (tied embedding / LM head) trained on 2 stages x 1
data-parallel rank with ZeRO-1 is saved, converted by ``ds_to_universal`` (one folder per global parameter name, the
tied weight once) and loaded with ``checkpoint.load_universal`` on 1 stage and on 2 stages x 2 data-parallel ranks;
the next two ``train_batch`` losses equal the original run's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from _pipe_models import gpt_batches, gpt_specs, lm_loss, shard

MICRO_BATCHES = 2  # per optimizer step, over all data-parallel ranks


def _engine(stages: int, dp: int, universal: bool, zero: int = 1):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": MICRO_BATCHES // dp,
              "steps_per_print": 10**6, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "gradient_clipping": 0.5, "zero_optimization": {"stage": zero},
              "checkpoint": {"load_universal": universal}}
    module = PipelineModule(gpt_specs(), num_stages=stages, loss_fn=lm_loss, seed_layers=True)
    return deepspeed.initialize(model=module, config=config)[0]


def _save_then_continue(save_dir: str, zero: int) -> list[float]:
    engine = _engine(2, 1, False, zero)
    it = iter(gpt_batches(8))
    for _ in range(2):
        engine.train_batch(it)
    engine.save_checkpoint(save_dir, tag="two")
    return [float(engine.train_batch(it)) for _ in range(2)]


def _resume_universal(save_dir: str, stages: int, zero: int) -> dict:
    dp = dist.get_world_size() // stages
    engine = _engine(stages, dp, True, zero)
    path, _ = engine.load_checkpoint(save_dir)
    rest = gpt_batches(8)[2 * MICRO_BATCHES:]
    it = iter(shard(rest, engine.grid.get_data_parallel_rank(), dp))
    return {"path": path, "steps": engine.global_steps, "losses": [float(engine.train_batch(it)) for _ in range(2)]}


def _convert(tmp_path_factory, zero: int):
    from deepspeed.checkpoint import ds_to_universal

    work = str(tmp_path_factory.mktemp(f"ucpipe{zero}"))
    expected = run_distributed(_save_then_continue, world_size=2, args=(work, zero), timeout=120)[0]
    out = os.path.join(work, "two_universal")
    assert ds_to_universal.main(["--input_folder", os.path.join(work, "two"), "--output_folder", out,
                                 "--inject_missing_state"]) == 0
    return work, out, expected


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return _convert(tmp_path_factory, 1)


def test_layout_one_folder_per_global_name(converted):
    _, out, _ = converted
    folders = set(os.listdir(os.path.join(out, "zero"))) - {"optimizer_state.pt"}
    names = {f"{layer}.{p}" for layer in range(1, 5) for p in (
        "ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.in_proj_weight", "attn.in_proj_bias",
        "attn.out_proj.weight", "attn.out_proj.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")}
    names |= {"5.weight", "5.bias", "tied_modules.embed.tok.weight", "tied_modules.embed.pos"}
    assert folders == names
    for key in ("fp32", "exp_avg", "exp_avg_sq", "step"):
        assert os.path.isfile(os.path.join(out, "zero", "tied_modules.embed.tok.weight", f"{key}.pt"))
    tok = torch.load(os.path.join(out, "zero", "tied_modules.embed.tok.weight", "fp32.pt"), weights_only=True)
    assert tok["param"].shape == (32, 16)
    for name in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "layer_00-model_states.pt"):
        assert os.path.isfile(os.path.join(out, name))


@pytest.mark.parametrize(("stages", "world"), [(1, 1), (2, 4)], ids=["1stage", "2stages-2dp"])
def test_load_universal_on_other_layouts(converted, stages, world):
    work, out, expected = converted
    results = run_distributed(_resume_universal, world_size=world, args=(work, stages, 1), timeout=120)
    for r in results:
        assert r["path"].endswith(os.path.join("two_universal", "mp_rank_00_model_states.pt"))
        assert r["steps"] == 2
    torch.testing.assert_close(torch.tensor(results[-1]["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)


@pytest.fixture(scope="module")
def converted_stage0(tmp_path_factory):
    return _convert(tmp_path_factory, 0)


@pytest.mark.parametrize(("stages", "world", "zero"), [(1, 1, 0), (2, 4, 1)], ids=["1stage", "2stages-2dp-zero1"])
def test_stage0_pipeline_checkpoint(converted_stage0, stages, world, zero):
    """Without ZeRO each stage's model-states file holds its optimizer state by name; converted the same way, it
    loads without ZeRO (the stage-0 wrapper's state is rebuilt by name) and into ZeRO-1."""
    work, out, expected = converted_stage0
    assert os.path.isfile(os.path.join(out, "zero", "tied_modules.embed.tok.weight", "exp_avg.pt"))
    results = run_distributed(_resume_universal, world_size=world, args=(work, stages, zero), timeout=120)
    assert all(r["steps"] == 2 for r in results)
    torch.testing.assert_close(torch.tensor(results[-1]["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)

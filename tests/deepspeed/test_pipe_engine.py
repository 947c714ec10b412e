"""The pipeline engine on real gloo ranks: ``train_batch`` of an 8-layer MLP and a tiny GPT with tied embeddings
equals the same model trained in one process (2 stages, and 2 stages x 2 data-parallel pipelines), with
activation checkpointing, every partition method, ZeRO-1, clipping; ``eval_batch``; exact resume, also onto
another number of stages; the checkpoint layout; and the errors that must not hang."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import DistributedTestFailure, run_distributed
from _pipe_models import gpt_batches, gpt_specs, lm_loss, mlp_batches, mlp_specs, reference_losses, shard
from torch import nn

from ds_pipe.p2p import TRAILER_BYTES

STEPS, GAS = 3, 3


def _config(**extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "gradient_clipping": 0.5}
    cfg.update(extra)
    return cfg


def _engine(specs, stages, config, loss_fn=nn.MSELoss(), **module_kwargs):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(specs, num_stages=stages, loss_fn=loss_fn, seed_layers=True, **module_kwargs)
    engine, *_ = deepspeed.initialize(model=module, config=config)
    return engine


def _train(kind, stages, steps=STEPS, config=None, **module_kwargs):
    specs, batches, loss_fn = _workload(kind, dist.get_world_size() // stages)
    engine = _engine(specs, stages, config or _config(), loss_fn, **module_kwargs)
    it = iter(shard(batches, engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()))
    return [float(engine.train_batch(it)) for _ in range(steps)]


def _workload(kind, dp):
    if kind == "mlp":
        return mlp_specs(), mlp_batches(STEPS * GAS * dp * 2), nn.MSELoss()
    return gpt_specs(), gpt_batches(STEPS * GAS * dp * 2), lm_loss


def _reference(kind, dp, steps=STEPS):
    specs, batches, loss_fn = _workload(kind, dp)
    return reference_losses(specs, batches, loss_fn, steps, GAS, dp, lr=1e-2, clip=0.5)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("world", [2, 4])
def test_train_batch_equals_one_process(kind, world):
    got = run_distributed(_train, world_size=world, args=(kind, 2), timeout=120)
    expected = _reference(kind, world // 2)
    for losses in got:  # every stage returns the batch loss
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


@pytest.mark.parametrize("options", [{"activation_checkpoint_interval": 1, "partition_method": "uniform"},
                                     {"partition_method": "type:Linear"},
                                     {"partition_method": [0, 3, 8]}], ids=["ckpt-uniform", "type-regex", "explicit"])
def test_partitions_and_activation_checkpointing(options):
    got = run_distributed(_train, world_size=2, args=("mlp", 2), kwargs=options, timeout=120)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(_reference("mlp", 1)), rtol=1e-5, atol=0)


def test_zero1_with_two_pipelines():
    cfg = _config(zero_optimization={"stage": 1})
    got = run_distributed(_train, world_size=4, args=("mlp", 2), kwargs={"config": cfg}, timeout=120)
    torch.testing.assert_close(torch.tensor(got[3]), torch.tensor(_reference("mlp", 2)), rtol=1e-5, atol=0)


def _bf16_vs_plain_engine():
    """bf16 through the pipeline against the same bf16 model in the plain engine (one process per rank)."""
    from _pipe_models import build_reference

    import deepspeed

    cfg = _config(bf16={"enabled": True})
    engine = _engine(mlp_specs(), 2, cfg, loss_fn=_float_mse)
    engine.set_batch_fn(lambda batch: (batch[0].bfloat16(), batch[1]))
    it = iter(mlp_batches(STEPS * GAS * 2))
    pipe = [float(engine.train_batch(it)) for _ in range(STEPS)]
    holder, funcs = build_reference(mlp_specs())
    plain, *_ = deepspeed.initialize(model=nn.Sequential(*funcs), config=cfg,
                                     mpu=_SoloMpu() if dist.get_world_size() > 1 else None)
    it = iter(mlp_batches(STEPS * GAS * 2))
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(GAS):
            x, y = next(it)
            loss = _float_mse(plain(x.bfloat16()), y)
            plain.backward(loss)
            plain.step()
            total += float(loss) / GAS
        losses.append(total)
    return pipe, losses


def _float_mse(out, y):
    return nn.functional.mse_loss(out.float(), y)


class _SoloMpu:
    """Each rank its own data-parallel group (the plain engine's reference runs alone on every rank)."""

    def __init__(self):
        self.groups = [dist.new_group([r]) for r in range(dist.get_world_size())]

    def get_data_parallel_group(self):
        return self.groups[dist.get_rank()]

    def get_model_parallel_group(self):
        return self.groups[dist.get_rank()]

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1


def test_bf16_matches_the_plain_engine():
    (pipe, plain), _ = run_distributed(_bf16_vs_plain_engine, world_size=2, timeout=120)
    torch.testing.assert_close(torch.tensor(pipe), torch.tensor(plain), rtol=2e-2, atol=0)


def _eval(stages):
    specs, batches, loss_fn = _workload("gpt", 1)
    engine = _engine(specs, stages, _config(), loss_fn)
    it = iter(batches)
    loss = engine.eval_batch(it)
    listed = engine.eval_batch(iter(batches), reduce_output=None, num_micro_batches=2)
    with_logits = engine.eval_batch(iter(batches), return_logits=True, bcast_loss=False)
    return {"loss": float(loss), "list": None if listed is None else [float(v) for v in listed],
            "logits": None if with_logits[1] is None else tuple(with_logits[1].shape),
            "params_unchanged": engine.global_steps == 0, "training": engine.module.training}


def test_eval_batch():
    got = run_distributed(_eval, world_size=2, args=(2,), timeout=120)
    specs, batches, loss_fn = _workload("gpt", 1)
    from _pipe_models import build_reference

    _, funcs = build_reference(specs)
    losses = []
    with torch.no_grad():
        for x, y in batches[:GAS]:
            for f in funcs:
                x = f(x)
            losses.append(float(loss_fn(x, y)))
    for r in got:
        assert r["loss"] == pytest.approx(sum(losses) / GAS, rel=1e-5)
        assert r["params_unchanged"] and r["training"]
    assert got[0]["list"] is None and got[1]["list"] == pytest.approx(losses[:2], rel=1e-5)
    assert got[0]["logits"] is None and got[1]["logits"] == (2, 8, 32)


# ---- checkpoints ---------------------------------------------------------------------------------------------

def _save_then_continue(stages, save_dir):
    specs, batches, loss_fn = _workload("gpt", 1)
    engine = _engine(specs, stages, _config(), loss_fn)
    it = iter(batches)
    for _ in range(2):
        engine.train_batch(it)
    engine.save_checkpoint(save_dir, tag="two")
    after = [float(engine.train_batch(it)) for _ in range(2)]
    return after, sorted(os.listdir(os.path.join(save_dir, "two")))


def _resume(stages, save_dir, **load_kwargs):
    specs, batches, loss_fn = _workload("gpt", 1)
    engine = _engine(specs, stages, _config(), loss_fn)
    path, client = engine.load_checkpoint(save_dir, tag="two", **load_kwargs)
    assert path is not None and engine.global_steps == 2
    it = iter(batches[2 * GAS:])
    return [float(engine.train_batch(it)) for _ in range(2)]


def test_resume_exactly_and_onto_other_stage_counts(tmp_path):
    saved = run_distributed(_save_then_continue, world_size=2, args=(2, str(tmp_path)), timeout=120)
    expected, files = saved[0]
    # DeepSpeed's layout: one file per module layer (layer 6, the tied head, is a function), one model-states file
    # per stage
    assert files == [*(f"layer_{i:02d}-model_states.pt" for i in range(6)), "mp_rank_00_model_states.pt",
                     "mp_rank_01_model_states.pt"]
    same = run_distributed(_resume, world_size=2, args=(2, str(tmp_path)), timeout=120)
    torch.testing.assert_close(torch.tensor(same[1]), torch.tensor(expected), rtol=1e-6, atol=0)
    one = run_distributed(_resume, world_size=1, args=(1, str(tmp_path)), timeout=120)
    torch.testing.assert_close(torch.tensor(one[0]), torch.tensor(expected), rtol=1e-5, atol=0)
    four = run_distributed(_resume, world_size=4, args=(4, str(tmp_path)), timeout=120)
    torch.testing.assert_close(torch.tensor(four[3]), torch.tensor(expected), rtol=1e-5, atol=0)


def test_checkpoint_loads_into_a_plain_model(tmp_path):
    from _pipe_models import build_reference

    from ds_pipe.checkpoint import consolidated_state_dict

    run_distributed(_save_then_continue, world_size=2, args=(2, str(tmp_path)), timeout=120)
    state = torch.load(tmp_path / "two" / "mp_rank_01_model_states.pt", weights_only=False)
    assert state["module"] is None and state["pipeline_parts"] == [0, 3, 7]
    holder, funcs = build_reference(gpt_specs())
    plain = nn.Sequential(*[f if isinstance(f, nn.Module) else nn.Identity() for f in funcs])
    weights = consolidated_state_dict(tmp_path / "two")
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.startswith("6.") for k in missing)  # layer 6 is the tied head (a function)
    torch.testing.assert_close(plain[0].tok.weight, weights["0.tok.weight"])


# ---- errors that must not hang ----------------------------------------------------------------------------

def _dry_iterator():
    engine = _engine(mlp_specs(), 2, _config())
    engine.train_batch(iter(mlp_batches(GAS + 1)))  # the second batch runs dry after one micro-batch
    engine.train_batch(iter(mlp_batches(1)))


def test_dry_iterator_fails_every_stage():
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_dry_iterator, world_size=2, timeout=60)
    text = str(info.value)
    assert "ran out after 1 of the 3 micro-batches" in text
    assert "rank 1" in text and text.count("ran out after 1 of the 3") >= 2  # both stages report the cause


def _shape_change(dynamic):
    engine = _engine(mlp_specs(), 2, _config(), dynamic_shape=dynamic)
    engine.train_batch(iter(mlp_batches(GAS, micro=4)))
    return float(engine.train_batch(iter(mlp_batches(GAS, micro=2))))


def test_shape_change_needs_dynamic_shape():
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_shape_change, world_size=2, args=(False,), timeout=60)
    text = str(info.value)
    assert "stage 0 -> stage 1" in text and "(4, 8) float32" in text and "(2, 8) float32" in text
    assert "dynamic_shape=True" in text and "rank 1" in text
    losses = run_distributed(_shape_change, world_size=2, args=(True,), timeout=60)
    assert losses[0] == losses[1] and losses[0] > 0


def _misuse():
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from ds_config import ConfigError
    from ds_pipe import PipelineError

    out = {}
    engine = _engine(mlp_specs(), 2, _config())
    for call in ("forward", "backward", "step"):
        with pytest.raises(PipelineError, match="Only train_batch"):
            getattr(engine, call)(torch.zeros(1))
    with torch.no_grad(), pytest.raises(RuntimeError, match="requires gradients enabled"):
        engine.train_batch(iter(mlp_batches(GAS)))
    for cfg, key in ((_config(zero_optimization={"stage": 2}), "zero_optimization.stage"),
                     (_config(pipeline={"stages": 4}), "pipeline.stages"),
                     (_config(pipeline={"partition": "uniform"}), "pipeline.partition")):
        module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss())
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            deepspeed.initialize(model=module, config=cfg)
    module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=module, config=_config(pipeline={"activation_checkpoint_interval": 2}))
    out["interval"] = engine.module.activation_checkpoint_interval
    out["ckpt_func"] = engine.module.activation_checkpoint_func.__module__
    with pytest.raises(ValueError, match="mpu must be None"):
        deepspeed.initialize(model=module, config=_config(), mpu=module.mpu())
    return out


def test_misuse_is_a_clear_error():
    got = run_distributed(_misuse, world_size=2, timeout=120)
    assert got[0]["interval"] == 2
    assert got[0]["ckpt_func"] == "deepspeed.runtime.activation_checkpointing.checkpointing"  # DeepSpeed's default


def _sliced(partitioned):
    """2 stages x 2 tensor slices (each slice a full copy: activations are identical across the slice group)."""
    from ds_pipe import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    cfg = _config(pipeline={"pipe_partitioned": partitioned, "grad_partitioned": partitioned})
    import deepspeed
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(mlp_specs(), topology=topo, loss_fn=nn.MSELoss(), seed_layers=True)
    engine, *_ = deepspeed.initialize(model=module, config=cfg)
    sent = []
    original = dist.isend

    def counting(tensor, dst, *args, **kwargs):
        if tensor.dtype == torch.uint8:  # a frame: one activation or gradient's bytes, then a trailer
            sent.append(tensor.numel())
        return original(tensor, dst, *args, **kwargs)

    dist.isend = counting
    try:
        it = iter(mlp_batches(STEPS * GAS))
        losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    finally:
        dist.isend = original
    return losses, max(sent, default=0)


def test_activations_partitioned_over_tensor_slices():
    expected = _reference("mlp", 1)
    for partitioned, numel in ((True, 16), (False, 32)):  # a (4, 8) activation: half of it per slice rank
        got = run_distributed(_sliced, world_size=4, args=(partitioned,), timeout=120)
        for losses, _ in got:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        assert max(largest for _, largest in got) == numel * 4 + TRAILER_BYTES


def _monitored(out_dir):
    cfg = _config(steps_per_print=1, csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "pipe"})
    return _train("mlp", 2, config=cfg)


def test_monitor_gets_the_last_stage_loss(tmp_path):
    got = run_distributed(_monitored, world_size=2, args=(str(tmp_path),), timeout=120)
    files = {p.name: p for p in tmp_path.rglob("*.csv")}
    rows = files["Train_Samples_train_loss.csv"].read_text().strip().splitlines()[1:]
    logged = [float(row.split(",")[1]) for row in rows]
    assert logged == pytest.approx(got[0], rel=1e-6)  # written by rank 0 (stage 0), measured on stage 1


def _fp16():
    cfg = _config(fp16={"enabled": True, "initial_scale_power": 8})
    engine = _engine(mlp_specs(), 2, cfg, loss_fn=_float_mse)
    engine.set_batch_fn(lambda batch: (batch[0].half(), batch[1]))
    it = iter(mlp_batches(STEPS * GAS))
    return [float(engine.train_batch(it)) for _ in range(STEPS)], engine.get_loss_scale()


def test_fp16_loss_scaling_across_stages():
    got = run_distributed(_fp16, world_size=2, timeout=120)
    assert got[0] == got[1] and got[0][1] == 2.0 ** 8
    torch.testing.assert_close(torch.tensor(got[0][0]), torch.tensor(_reference("mlp", 1)), rtol=1e-2, atol=0)

"""Curriculum data sampling through ``deepspeed.initialize(training_data=...)``: the engine's training loader
samples by difficulty, and a checkpoint resumes the same batches, losses and random-LTD schedule exactly."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _data_sampling_toy import METRIC, ToyDataset, analyze, data_efficiency, difficulty_of
from _harness import run_distributed

RANDOM_LTD = {"enabled": True, "random_ltd": {
    "enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1, "random_ltd_layer_id": [0],
    "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
    "random_ltd_schedule": {"min_value": 2, "max_value": 8, "schedule_type": "fixed_linear",
                            "schedule_config": {"require_steps": 10, "seq_per_step": 2}}}}


class _Scorer(torch.nn.Module):
    """A loss over the toy samples ``[id, difficulty]``; records the sample ids of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return (self.lin(batch.float() / 10) ** 2).mean()


def _engine(de_config: dict, micro: int = 2):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "data_efficiency": de_config}
    engine, _, loader, _ = deepspeed.initialize(model=_Scorer(), training_data=ToyDataset(), config=config)
    return engine, loader


def _train(engine, batches, steps: int) -> list[tuple[list[int], float, dict]]:
    """``steps`` optimizer steps; per micro batch: (global sample ids of this rank, loss, random-LTD state)."""
    sampler = engine.training_dataloader.data_sampler
    out = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        batch = next(batches)
        assert max(difficulty_of(int(i)) for i in batch[:, 0]) <= sampler.current_difficulties[METRIC]
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        out.append((batch[:, 0].tolist(), loss.item(), dict(engine.random_ltd_scheduler.state_dict())))
    return out


def _save_continue_resume(de_config: dict, ckpt: str) -> tuple[list, list, dict, dict]:
    engine, loader = _engine(de_config)
    assert engine.curriculum_learning_enabled() and loader is engine.training_dataloader
    batches = iter(loader)
    _train(engine, batches, 3)
    engine.save_checkpoint(ckpt)
    saved_sampler = engine.training_dataloader.data_sampler.state_dict()
    expected = _train(engine, batches, 3)
    resumed, _ = _engine(de_config)
    resumed.load_checkpoint(ckpt)
    restored = resumed.training_dataloader.data_sampler.state_dict()
    got = _train(resumed, iter(resumed.training_dataloader), 3)
    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, [b for b, _, _ in expected])
    return expected, got, {"saved": saved_sampler, "restored": restored}, {"ids": ids}


def test_engine_samples_by_curriculum_and_resumes_exactly(tmp_path):
    index = analyze(str(tmp_path / "analysis"))
    de_config = {**data_efficiency(index, str(tmp_path / "clusters"), schedule_config={
        "total_curriculum_step": 4, "difficulty_step": 1}), "data_routing": RANDOM_LTD}
    results = run_distributed(_save_continue_resume, world_size=2, args=(de_config, str(tmp_path / "ckpt")),
                              timeout=120)
    for expected, got, sampler_states, _ in results:
        assert got == expected  # same sample ids, same losses, same random-LTD schedule and consumed tokens
        assert sampler_states["restored"] == results[0][2]["saved"]  # every rank reads rank 0's sampler state
        assert expected[-1][2]["consumed_layer_tokens"] > expected[0][2]["consumed_layer_tokens"] > 0
    rank0, rank1 = results[0][3]["ids"]
    for mine, theirs in zip(rank0, rank1, strict=True):  # the two ranks split each micro batch of 4
        assert len(mine) == len(theirs) == 2 and not set(mine) & set(theirs)


def _custom_difficulties(de_config: dict) -> list[int]:
    engine, loader = _engine(de_config, micro=4)
    engine.set_custom_curriculum_learning_schedule({METRIC: lambda step: min(12, 2 * step + 1)})
    # DeepSpeed's hook: each batch with the sampler's state (e.g. to truncate sequences to the difficulty)
    loader.post_process_func = lambda batch, state: (batch, state["current_difficulties"][METRIC])
    sampler, batches, seen = loader.data_sampler, iter(loader), []
    for _ in range(6):
        batch, difficulty = next(batches)
        seen.append(difficulty)
        assert difficulty == sampler.current_difficulties[METRIC]
        assert max(difficulty_of(int(i)) for i in batch[:, 0]) <= difficulty
    return seen


def test_engine_custom_curriculum_schedule(tmp_path):
    index = analyze(str(tmp_path / "analysis"))
    de_config = data_efficiency(index, str(tmp_path / "clusters"), schedule_type="custom")
    seen = run_distributed(_custom_difficulties, world_size=1, args=(de_config,), timeout=60)[0]
    assert seen == [3, 3, 5, 5, 7, 7]  # one global batch (2 micro batches) per curriculum step

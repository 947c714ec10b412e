"""ZeRO stages 1-3 with DeepSpeed-Ulysses sequence parallelism (``sequence_parallel_size`` in the config).

A pre-norm transformer block whose attention runs ``DistributedAttention`` over the sequence group trains on 2
ranks, each holding half of every sequence, with ZeRO 0-3 partitioned over the sequence-data group; the losses and
weights must follow plain single-process training of the whole sequence (SGD, so a gradient scaled by the wrong
factor shows; clipping is on, above the norm, so the engine computes the global norm over the partitions, which
must equal the one-process norm). A checkpoint of stages 1 and 3 (each sequence rank holds its own ZeRO shard, so
files are named by the sequence-data rank, as DeepSpeed does) loads into a fresh engine that continues identically.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ, BATCH, HIDDEN, HEADS, STEPS, LR, CLIP = 8, 2, 16, 4, 3, 0.1, 100.0


def _attend(q, k, v):
    """Causal attention over [s, b, h, d]."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    return out.permute(2, 0, 1, 3)


def _ulysses(q, k, v):
    """The same attention with the sequence split over the registered sequence-parallel group."""
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups

    return DistributedAttention(_attend, groups._get_sequence_parallel_group())(q, k, v, 1)


class _Block(torch.nn.Module):
    def __init__(self, attention) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = torch.nn.Linear(HIDDEN, 3 * HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                       torch.nn.Linear(2 * HIDDEN, HIDDEN))
        self.attention = attention

    def forward(self, x):
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(s, b, 3, HEADS, HIDDEN // HEADS).unbind(dim=2)
        x = x + self.proj(self.attention(q, k, v).reshape(s, b, HIDDEN))
        return x + self.mlp(self.norm2(x))


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=gen), torch.randn(SEQ, BATCH, HIDDEN, generator=gen)


def _reference() -> tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole sequence: losses, gradient norms and final weights of SGD, plus the initial
    weights."""
    x, target = _data()
    torch.manual_seed(2)
    model = _Block(_attend)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((model(x) - target) ** 2).sum() / x.numel()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        losses.append(loss.item())
        opt.step()
    return losses, norms, model.state_dict(), initial


def _config(stage: int, sp: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**6, "sequence_parallel_size": sp,
            "gradient_clipping": CLIP, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}}


def _full_weights(engine) -> dict[str, torch.Tensor]:
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _checkpoint_round_trip(engine, stage: int, initial: dict, folder: str) -> None:
    """Save, load into a fresh engine: the same weights, and the next step the same on both (ZeRO shards differ
    between the two sequence ranks: each must write and read its own file)."""
    import deepspeed

    engine.save_checkpoint(folder, tag=f"s{stage}")
    model = _Block(_ulysses)
    model.load_state_dict(initial)
    loaded, *_ = deepspeed.initialize(model=model, config=_config(stage))
    loaded.load_checkpoint(folder, tag=f"s{stage}")
    before = _full_weights(engine)
    for name, value in _full_weights(loaded).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=f"stage {stage} loaded: {name}")
    x, target = _data()
    xs, ts = x.chunk(2)[dist.get_rank()], target.chunk(2)[dist.get_rank()]
    for e in (engine, loaded):
        e.backward(((e(xs) - ts) ** 2).sum() / x.numel())
        e.step()
    after = _full_weights(engine)
    for name, value in _full_weights(loaded).items():
        torch.testing.assert_close(value, after[name], **TOL, msg=f"stage {stage} after a step: {name}")


def _train_all_stages(folder: str) -> dict[int, list[float]]:
    import deepspeed
    from deepspeed.utils import groups

    rank = dist.get_rank()
    expected, expected_norms, final, initial = _reference()
    x, target = _data()
    xs, ts = x.chunk(2)[rank], target.chunk(2)[rank]
    results, seen = {}, []
    for stage in (0, 1, 2, 3):
        model = _Block(_ulysses)
        model.load_state_dict(initial)
        engine, *_ = deepspeed.initialize(model=model, config=_config(stage))
        assert groups._get_sequence_parallel_world_size() == 2 and engine.dp_world_size == 1
        seen.append(groups._get_sequence_parallel_group())  # built once, shared by every engine
        got, norms = [], []
        for _ in range(STEPS):
            loss = ((engine(xs) - ts) ** 2).sum() / x.numel()  # this rank's share of the whole loss
            engine.backward(loss)
            engine.step()
            norms.append(float(engine.get_global_grad_norm()))
            total = loss.detach().clone()
            dist.all_reduce(total)
            got.append(total.item())
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **TOL, msg=f"stage {stage} losses")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), **TOL,
                                   msg=f"stage {stage} gradient norms")
        for name, value in _full_weights(engine).items():
            torch.testing.assert_close(value, final[name], **TOL, msg=f"stage {stage}: {name}")
        results[stage] = got
        if stage in (1, 3):
            _checkpoint_round_trip(engine, stage, initial, folder)
    assert all(g is seen[0] for g in seen)
    return results


def test_zero_stages_with_sequence_parallelism_follow_one_process_training(tmp_path):
    results = run_distributed(_train_all_stages, world_size=2, args=(str(tmp_path),), timeout=120)
    assert results[0] == results[1]
    assert all(r[-1] < r[0] for r in results[0].values())


def _config_errors() -> None:
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from ds_config import ConfigError

    # DeepSpeed's config object (Hugging Face's zero.Init path, no mpu): the sequence ranks share each sample
    assert DeepSpeedConfig(_config(0, sp=2)).world_size == 1 and DeepSpeedConfig(_config(0, sp=1)).world_size == 2

    with pytest.raises(ConfigError, match=r"sequence_parallel_size.*must divide the world size \(2\)"):
        deepspeed.initialize(model=_Block(_attend), config=_config(0, sp=3))

    class _Mpu:  # a client mpu whose sequence axis disagrees with the config
        def get_data_parallel_group(self):
            return dist.group.WORLD

        def get_model_parallel_rank(self):
            return 0

        def get_model_parallel_world_size(self):
            return 1

        def get_sequence_parallel_world_size(self):
            return 1

    with pytest.raises(ConfigError, match="sequence_parallel_size.*sequence-parallel size of 1"):
        deepspeed.initialize(model=_Block(_attend), config=_config(0, sp=2), mpu=_Mpu())

    onebit = {**_config(0), "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}}
    with pytest.raises(ConfigError, match="sequence_parallel_size.*1-bit optimizers.*with a 1-bit optimizer: 1"):
        deepspeed.initialize(model=_Block(_attend), config=onebit)


def test_sequence_parallel_size_errors():
    run_distributed(_config_errors, world_size=2, timeout=60)
    from ds_config import ConfigError, load_config

    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        load_config(_config(0, sp=0))


def test_sequence_parallelism_reduces_in_seq_parallel_communication_data_type():
    """As DeepSpeed's engine: with sequence parallelism ``seq_parallel_communication_data_type`` (default fp32)
    replaces ``communication_data_type`` for the gradient reduction."""
    from deepspeed.runtime.engine._precision import comm_dtype as _comm_dtype
    from ds_config import ConfigError, load_config

    bf16 = {"bf16": {"enabled": True}, "communication_data_type": "bf16"}
    assert _comm_dtype(load_config({**_config(2, sp=1), **bf16})) is torch.bfloat16
    assert _comm_dtype(load_config({**_config(2), **bf16})) is torch.float32
    assert _comm_dtype(load_config({**_config(2), **bf16, "seq_parallel_communication_data_type": "fp16"})) \
        is torch.float16
    with pytest.raises(ConfigError, match="seq_parallel_communication_data_type"):
        load_config({**_config(2), "seq_parallel_communication_data_type": "int8"})

"""DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``) against single-rank attention.

Each rank holds a contiguous slice of the sequence; the sharded result must equal the full computation sliced
(outputs and input gradients), and a small transformer block trained with the sequence split over 2 ranks must
follow the single-rank loss curve when the replicated weights' gradients are summed over the sequence group
(what DeepSpeed's engine does: all-reduce over the sequence-data-parallel group, divide by data parallel only).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import run_distributed

from deepspeed.sequence.layer import DistributedAttention

TOL = dict(rtol=1e-5, atol=1e-5)


def _causal_sdpa(batch_dim_idx: int):
    """Local attention over [s, b, h, d] (batch_dim_idx=1) or [b, s, h, d] (0), causal over the sequence; with
    fewer key/value heads than query heads, query head j attends with key/value head j // group (GQA)."""

    def attend(q, k, v):
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if batch_dim_idx == 1 else (lambda t: t.transpose(1, 2))
        out = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), is_causal=True)
        return out.permute(2, 0, 1, 3) if batch_dim_idx == 1 else out.transpose(1, 2)

    return attend


def _rotate(t, cos, sin):  # reference rotary embedding, written independently of the module's
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def _attention_matches(batch_dim_idx: int, heads: int, rotary: bool, kv_heads: int | None = None,
                       layer_kwargs: dict | None = None) -> None:
    """Sharded outputs and q/k/v gradients equal the one-rank attention sliced along the sequence."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seq, batch, dim = 8, 2, 8
    gen = torch.Generator().manual_seed(0)
    shape = (seq, batch, heads, dim) if batch_dim_idx == 1 else (batch, seq, heads, dim)
    kv_shape = shape[:2] + (kv_heads or heads, dim)
    q, upstream = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k, v = torch.randn(kv_shape, generator=gen), torch.randn(kv_shape, generator=gen)
    seq_dim = 1 - batch_dim_idx
    attend = _causal_sdpa(batch_dim_idx)
    rope = None
    if rotary:
        angles = torch.randn(batch, seq, 1, dim // 2, generator=gen).repeat(1, 1, 1, 2)
        rope = (angles.cos(), angles.sin())

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    fq, fk = full[0], full[1]
    if rotary:
        cos, sin = (r.permute(1, 0, 2, 3) for r in rope) if batch_dim_idx == 1 else rope
        fq, fk = _rotate(fq, cos, sin), _rotate(fk, cos, sin)
    expected = attend(fq, fk, full[2])
    expected.backward(upstream)

    local = [t.chunk(world, dim=seq_dim)[rank].clone().requires_grad_() for t in (q, k, v)]
    layer = DistributedAttention(attend, dist.group.WORLD, **(layer_kwargs or {}))
    out = layer(*local, batch_dim_idx, rope)
    out.backward(upstream.chunk(world, dim=seq_dim)[rank])

    torch.testing.assert_close(out, expected.chunk(world, dim=seq_dim)[rank], **TOL)
    for name, mine, ref in zip("qkv", local, full, strict=True):
        torch.testing.assert_close(mine.grad, ref.grad.chunk(world, dim=seq_dim)[rank], **TOL, msg=f"d{name}")


@pytest.mark.parametrize("batch_dim_idx", [0, 1], ids=["batch_first", "seq_first"])
def test_two_ranks_equal_one_rank_outputs_and_input_gradients(batch_dim_idx):
    run_distributed(_attention_matches, world_size=2, args=(batch_dim_idx, 4, False), timeout=60)


@pytest.mark.parametrize(("batch_dim_idx", "gather_idx"), [(0, 1), (0, 0), (1, 0), (1, 1)],
                         ids=["bshd_gather1", "bshd_gather0", "sbhd_gather0", "sbhd_gather1"])
def test_layout_follows_batch_dim_idx_not_gather_idx(batch_dim_idx, gather_idx):
    """DeepSpeed's rule: batch_dim_idx alone says where the sequence is; gather_idx only says the direction of
    the way back. [b, s/P, h, d] with scatter_idx=2, gather_idx=1 (the batch-first spelling) used to gather
    along the batch and return wrong values without an error."""
    kwargs = {"scatter_idx": 2, "gather_idx": gather_idx}
    run_distributed(_attention_matches, world_size=2, args=(batch_dim_idx, 4, False, None, kwargs), timeout=60)


@pytest.mark.parametrize("batch_dim_idx", [0, 1], ids=["batch_first", "seq_first"])
def test_four_ranks_and_rotary_embedding(batch_dim_idx):
    run_distributed(_attention_matches, world_size=4, args=(batch_dim_idx, 4, True), timeout=60)


def test_one_rank_is_plain_attention():
    run_distributed(_attention_matches, world_size=1, args=(1, 3, True), timeout=60)


@pytest.mark.parametrize("batch_dim_idx", [0, 1], ids=["batch_first", "seq_first"])
def test_uneven_heads_split_over_two_ranks(batch_dim_idx):
    """3 heads over 2 ranks: rank 0 attends over heads 0-1, rank 1 over head 2 (DeepSpeed's uneven path)."""
    run_distributed(_attention_matches, world_size=2, args=(batch_dim_idx, 3, False), timeout=60)


@pytest.mark.parametrize(("batch_dim_idx", "world", "heads", "kv_heads"),
                         [(0, 2, 6, 3), (1, 2, 6, 3), (1, 4, 10, 5), (0, 4, 8, 4), (1, 2, 8, 2)],
                         ids=["bshd_P2_6q3kv", "sbhd_P2_6q3kv", "sbhd_P4_10q5kv", "bshd_P4_8q4kv", "sbhd_P2_8q2kv"])
def test_grouped_query_attention_keeps_each_query_head_with_its_kv_group(batch_dim_idx, world, heads, kv_heads):
    """GQA: key/value heads dealt first (uneven when they do not divide by P), each rank's query heads are the
    ones of its key/value groups; outputs and gradients equal one-rank GQA attention."""
    run_distributed(_attention_matches, world_size=world, args=(batch_dim_idx, heads, True, kv_heads), timeout=90)


def _explicit_num_kv_heads() -> None:
    """num_kv_heads given to the layer: it decides the partition (here 3 kv heads over 2 ranks)."""
    _attention_matches(1, 6, False, 3, {"num_kv_heads": 3})


def test_explicit_num_kv_heads():
    run_distributed(_explicit_num_kv_heads, world_size=2, timeout=60)


def _head_placement(batch_dim_idx: int) -> list[list[int]]:
    """After the first exchange each rank sees the full sequence of a contiguous block of heads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    heads, seq_local, batch = 5, 2, 3
    seq_dim = 1 - batch_dim_idx
    # element value = 100 * global position + head, constant over batch and head_dim
    pos = torch.arange(seq_local) + rank * seq_local
    value = (100 * pos[:, None] + torch.arange(heads)[None, :]).float()  # [s/P, h]
    shape = (seq_local, batch, heads, 2) if batch_dim_idx == 1 else (batch, seq_local, heads, 2)
    x = value.unsqueeze(1 - seq_dim).unsqueeze(-1).expand(shape).contiguous()
    seen = {}

    def capture(q, k, v):
        seen["q"] = q
        return q

    out = DistributedAttention(capture, dist.group.WORLD)(x, x, x, batch_dim_idx)
    torch.testing.assert_close(out, x, rtol=0, atol=0)  # the way back undoes the first exchange exactly
    q = seen["q"]
    assert q.shape[seq_dim] == seq_local * world
    positions = q.select(1 - seq_dim, 0)[..., 0] // 100  # [s, local heads]
    assert torch.equal(positions[:, 0], torch.arange(seq_local * world).float())
    return (q.select(1 - seq_dim, 0)[0, :, 0] % 100).int().tolist()


@pytest.mark.parametrize("batch_dim_idx", [0, 1], ids=["batch_first", "seq_first"])
def test_heads_dealt_in_contiguous_blocks_first_ranks_one_more(batch_dim_idx):
    assert run_distributed(_head_placement, world_size=2, args=(batch_dim_idx,), timeout=60) == [[0, 1, 2], [3, 4]]


class _Block(torch.nn.Module):
    """Pre-norm transformer block over [s, b, hidden]; ``attention(q, k, v)`` takes [s, b, heads, dim]."""

    def __init__(self, hidden: int, heads: int, attention) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(2 * hidden, hidden))
        self.attention = attention

    def forward(self, x):
        s, b, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(s, b, 3, self.heads, hidden // self.heads).unbind(dim=2)
        x = x + self.proj(self.attention(q, k, v).reshape(s, b, hidden))
        return x + self.mlp(self.norm2(x))


def _train(model, x, target, total: int, group) -> list[float]:
    """3 SGD steps on a sum-of-squares loss normalised by the global element count; gradients summed over
    ``group`` (the sequence group) as the engine's reduction would."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = ((model(x) - target) ** 2).sum() / total
        loss.backward()
        if group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=group)
        losses.append(loss.item())
        opt.step()
    return losses


def _blocks() -> tuple[torch.Tensor, torch.Tensor, _Block, _Block]:
    """Data, a one-rank block and its copy whose attention runs Ulysses over the world."""
    seq, batch, hidden, heads = 8, 2, 16, 4
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(seq, batch, hidden, generator=gen), torch.randn(seq, batch, hidden, generator=gen)
    torch.manual_seed(2)
    reference = _Block(hidden, heads, _causal_sdpa(1))
    sharded = _Block(hidden, heads, None)
    sharded.load_state_dict(reference.state_dict())
    sp_attention = DistributedAttention(_causal_sdpa(1), dist.group.WORLD)
    sharded.attention = lambda q, k, v: sp_attention(q, k, v, 1)
    return x, target, reference, sharded


def _block_training_matches() -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, target, reference, sharded = _blocks()
    expected = _train(reference, x, target, x.numel(), None)
    got = _train(sharded, x.chunk(world)[rank], target.chunk(world)[rank], x.numel(), dist.group.WORLD)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **TOL)
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(p, reference.state_dict()[name], **TOL, msg=name)
    return got


def test_block_trained_with_half_the_sequence_per_rank_follows_the_one_rank_losses():
    losses = run_distributed(_block_training_matches, world_size=2, timeout=60)
    assert losses[0] == losses[1] and losses[0][2] < losses[0][0]


def _errors() -> None:
    layer = DistributedAttention(_causal_sdpa(1), dist.group.WORLD)
    q = torch.randn(4, 2, 4, 8)
    with pytest.raises(ValueError, match="batch_dim_idx must be 0"):
        layer(q, q, q, 2)
    with pytest.raises(ValueError, match="expected 4 dims"):
        layer(q[..., 0, 0], q[..., 0, 0], q[..., 0, 0], 1)
    one_head = torch.randn(4, 2, 1, 8)
    with pytest.raises(ValueError, match=r"num_kv_heads \(1\) must be at least the sequence parallel size \(2\)"):
        layer(q, one_head, one_head, 1)
    with pytest.raises(ValueError, match=r"heads of query \(5\) must be a multiple of num_kv_heads \(3\)"):
        layer(torch.randn(4, 2, 5, 8), torch.randn(4, 2, 3, 8), torch.randn(4, 2, 3, 8), 1)
    with pytest.raises(ValueError, match=r"heads of value \(3\) must be divisible"):  # before any communication
        layer(q, q, torch.randn(4, 2, 3, 8), 1)


def test_errors():
    run_distributed(_errors, world_size=2, timeout=60)
    with pytest.raises(ValueError, match=r"one of scatter_idx \(0\) and gather_idx \(1\) must be the heads dim"):
        DistributedAttention(_causal_sdpa(1), None, scatter_idx=0, gather_idx=1)
    with pytest.raises(ValueError, match="scatter_idx"):
        DistributedAttention(_causal_sdpa(1), None, scatter_idx=2, gather_idx=2)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive integer"):
        DistributedAttention(_causal_sdpa(1), None, num_kv_heads=0)


def test_package_surface():
    import deepspeed.sequence
    import deepspeed.sequence.layer as layer

    assert deepspeed.sequence.DistributedAttention is layer.DistributedAttention


class _SequenceMpu:
    """2 ranks, one sequence-parallel group of both, data parallelism of 1 (each rank its own data group)."""

    def __init__(self) -> None:
        self.own = [dist.new_group([r]) for r in range(dist.get_world_size())]

    def get_data_parallel_group(self):
        return self.own[dist.get_rank()]

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_sequence_parallel_world_size(self):
        return dist.get_world_size()

    def get_sequence_data_parallel_group(self):
        return dist.group.WORLD


def _engine_training_matches() -> list[float]:
    """The engine with a sequence mpu sums the sequence ranks' gradients (each rank's loss is its share)."""
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    x, target, reference, sharded = _blocks()
    expected = _train(reference, x, target, x.numel(), None)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=sharded, config=cfg, mpu=_SequenceMpu())
    xs, ts = x.chunk(world)[rank], target.chunk(world)[rank]
    got = []
    for _ in range(3):
        loss = ((engine(xs) - ts) ** 2).sum() / x.numel()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        got.append(total.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **TOL)
    for name, p in engine.module.named_parameters():
        torch.testing.assert_close(p, reference.state_dict()[name], **TOL, msg=name)
    return got


def test_engine_reduces_gradients_over_the_sequence_group():
    losses = run_distributed(_engine_training_matches, world_size=2, timeout=60)
    assert losses[0] == losses[1]

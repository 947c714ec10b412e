"""Block-sparse attention that computes only the layout's blocks: time and memory grow with the non-zero blocks.

The plan groups, per head, the query block rows that see the same key block columns (a Fixed or Variable window
shares one column set; a sliding window row has its own). A chunk stacks n group pieces of one shape (g rows, k
columns), gathers their query blocks ``[B, n, g*block, D]`` and key/value blocks ``[B, n, k*block, D]`` and
attends within them: dense GEMMs over only the kept blocks, no padding, key blocks gathered once per group rather
than once per row. Chunks hold at most ``chunk_elements`` scores (batch included).

Like flash attention, the forward keeps only the output and each row's log-sum-exp; the backward recomputes a
chunk's scores from them, so memory beyond inputs, output and gradients is one chunk's work space plus O(L) per
head, never ``[B, H, L, L]``. ``masked_dense.masked_dense_attention`` is the plain reference it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .masked_dense import additive_mask

DEFAULT_CHUNK_ELEMENTS = 1 << 20  # scores per chunk (4 MiB in fp32); a chunk's whole work space is a few times that


@dataclass(frozen=True)
class _Group:
    head: int
    rows: tuple[int, ...]  # query block rows that see exactly ``cols``
    cols: tuple[int, ...]  # key block columns, ascending


@dataclass(frozen=True)
class _Chunk:
    heads: torch.Tensor  # [n]
    rows: torch.Tensor  # [n, g]: n pieces of g query block rows each
    cols: torch.Tensor  # [n, k]: each piece's k key block columns
    query_index: torch.Tensor  # [n*g]: head * nb + row, the rows in ``[B, H*nb, ...]`` tensors
    key_index: torch.Tensor  # [n*k]: head * nb + col


@dataclass(eq=False)
class BlockPlan:
    """A layout as groups of query block rows (per head) that see the same key block columns."""

    num_heads: int
    num_blocks: int
    block: int
    groups: tuple[_Group, ...]
    device: torch.device
    _chunks: dict = field(default_factory=dict, repr=False)

    @property
    def nnz_blocks(self) -> int:
        return sum(len(g.rows) * len(g.cols) for g in self.groups)

    def chunks(self, batch: int, budget: int) -> list[_Chunk]:
        """Pieces of groups (at most ``budget`` scores each, batch included, unless one block row alone is more)
        batched by shape (rows, columns), so that no chunk needs padding."""
        key = (batch, budget)
        if key not in self._chunks:
            per_pair = batch * self.block * self.block
            shapes: dict[tuple[int, int], list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
            for grp in self.groups:
                step = max(1, budget // (len(grp.cols) * per_pair))
                for i in range(0, len(grp.rows), step):
                    rows = grp.rows[i:i + step]
                    shapes.setdefault((len(rows), len(grp.cols)), []).append((grp.head, rows, grp.cols))
            chunks = []
            for (g, k), pieces in shapes.items():
                step = max(1, budget // (g * k * per_pair))
                for i in range(0, len(pieces), step):
                    heads, rows, cols = (torch.tensor(x, dtype=torch.long, device=self.device)
                                         for x in zip(*pieces[i:i + step], strict=True))
                    base = heads[:, None] * self.num_blocks
                    chunks.append(_Chunk(heads, rows, cols, (base + rows).reshape(-1), (base + cols).reshape(-1)))
            self._chunks[key] = chunks
        return self._chunks[key]


def make_plan(layout: torch.Tensor, block: int, device: torch.device | str = "cpu") -> BlockPlan:
    """The plan of an ``[H, nb, nb]`` layout (non-zero: the block is attended)."""
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"layout must be [heads, num_blocks, num_blocks], got shape {list(layout.shape)}")
    keep = layout.detach().to("cpu").bool()
    groups = []
    for head in range(keep.shape[0]):
        patterns, which = torch.unique(keep[head], dim=0, return_inverse=True)
        for index, pattern in enumerate(patterns):
            cols = tuple(pattern.nonzero().flatten().tolist())
            if cols:
                groups.append(_Group(head, tuple((which == index).nonzero().flatten().tolist()), cols))
    return BlockPlan(keep.shape[0], keep.shape[1], block, tuple(groups), torch.device(device))


def _scores(c: _Chunk, qb, kb, scale, block, rpe, kpm, kpm_mode, am, am_mode, shift=None):
    """Chunk scores ``[B*n, g*block, k*block]`` with rpe and masks added and ``shift`` (``[B*n, g*block, 1]``)
    subtracted; also the gathered query blocks times scale and key blocks (``[B*n, g*block or k*block, D]``).
    qb, kb: ``[B, H*nb, block*D]``."""
    (n, g), k = c.rows.shape, c.cols.shape[1]
    bsz, d = qb.shape[0], qb.shape[-1] // block
    q = qb.index_select(1, c.query_index).view(bsz * n, g * block, d).mul_(scale)
    keys = kb.index_select(1, c.key_index).view(bsz * n, k * block, d)
    if shift is None:
        s = torch.bmm(q, keys.transpose(1, 2))
    else:  # the subtraction rides on the GEMM's accumulate
        s = torch.baddbmm(shift.neg(), q, keys.transpose(1, 2))
    s4 = s.view(bsz, n, g * block, k * block)
    rows, cols = c.rows[:, :, None], c.cols[:, None, :]
    if rpe is not None:  # [Br, Hr, nb, nb, block, block]
        heads = c.heads if rpe.shape[1] > 1 else torch.zeros_like(c.heads)
        blocks = rpe[:, heads[:, None, None], rows, cols]  # [Br, n, g, k, block, block]
        s4 += blocks.permute(0, 1, 2, 4, 3, 5).reshape(rpe.shape[0], n, g * block, k * block)
    if kpm is not None:  # [B, nb, block]
        s4 += additive_mask(kpm.index_select(1, c.cols.reshape(-1)).view(bsz, n, 1, k * block), kpm_mode)
    if am is not None:  # [nb, nb, block, block]
        s4 += additive_mask(am[rows, cols].permute(0, 1, 3, 2, 4).reshape(n, g * block, k * block), am_mode)
    return s, q, keys


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[B, H, L, D]`` -> ``[B, H*L/block, block*D]``: one row per (head, block), for index_select."""
    return x.contiguous().view(x.shape[0], -1, block * x.shape[3])


def _pair_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[..., L, L]`` -> ``[..., nb, nb, block, block]`` view: entry ``[.., r, c]`` is block (r, c)."""
    nb = x.shape[-1] // block
    return x.reshape(*x.shape[:-2], nb, block, nb, block).transpose(-3, -2)


def _masks(rpe, kpm, am, bsz, block):
    return (_rpe_blocks(rpe, block), None if kpm is None else kpm.reshape(bsz, -1, block),
            None if am is None else _pair_blocks(am, block))


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rpe, kpm, am, plan, scale, kpm_mode, am_mode, budget):
        bsz, heads, length, d = q.shape
        block = plan.block
        rpe_b, kpm_b, am_b = _masks(rpe, kpm, am, bsz, block)
        biased = rpe is not None or kpm is not None or am is not None
        qb, kb, vb = _blocked(q, block), _blocked(k, block), _blocked(v, block)
        out = q.new_zeros(bsz, heads * plan.num_blocks, block * d)
        lse = q.new_full((bsz, heads * plan.num_blocks, block), float("inf"))  # +inf: the row attends nothing
        for c in plan.chunks(bsz, budget):
            (n, g), kc = c.rows.shape, c.cols.shape[1]
            s, _, _ = _scores(c, qb, kb, scale, block, rpe_b, kpm_b, kpm_mode, am_b, am_mode)
            m = s.amax(-1, keepdim=True)
            if biased:  # only masks can leave a row nothing: then m = -inf, and 0 with exp(-inf - 0) = 0
                m.masked_fill_(m == float("-inf"), 0.0)
            p = s.sub_(m).exp_()
            total = p.sum(-1, keepdim=True)
            values = vb.index_select(1, c.key_index).view(bsz * n, kc * block, d)
            empty = None
            if biased:
                empty = total == 0
                total.masked_fill_(empty, 1.0)  # 0 / 1: the row gives 0
            o = torch.bmm(p, values).div_(total)
            out.index_copy_(1, c.query_index, o.view(bsz, n * g, block * d))
            row_lse = m.add_(total.log_())
            if empty is not None:
                row_lse.masked_fill_(empty, float("inf"))
            lse.index_copy_(1, c.query_index, row_lse.view(bsz, n * g, block))
        out = out.reshape(bsz, heads, length, d)
        ctx.save_for_backward(q, k, v, out, lse, rpe, kpm, am)
        ctx.setup = (plan, scale, kpm_mode, am_mode, budget)
        ctx.rpe_shape = None if rpe is None else rpe.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rpe, kpm, am = ctx.saved_tensors
        plan, scale, kpm_mode, am_mode, budget = ctx.setup
        bsz, heads, length, d = q.shape
        block, nb = plan.block, plan.num_blocks
        rpe_b, kpm_b, am_b = _masks(rpe, kpm, am, bsz, block)
        dout = dout.contiguous()
        delta = torch.bmm(dout.view(-1, 1, d), out.view(-1, d, 1)).view(bsz, heads * nb, block)  # rowsum(dO * O)
        qb, kb, vb, gb = _blocked(q, block), _blocked(k, block), _blocked(v, block), _blocked(dout, block)
        biased = rpe is not None or kpm is not None or am is not None
        dq = q.new_zeros(bsz, heads * nb, block * d)
        dk = q.new_zeros(bsz, heads * nb, block * d)
        dv = q.new_zeros(bsz, heads * nb, block * d)
        drpe = q.new_zeros(bsz, heads * nb * nb, block, block) if ctx.needs_input_grad[3] else None
        for c in plan.chunks(bsz, budget):
            (n, g), kc = c.rows.shape, c.cols.shape[1]
            row_lse = lse.index_select(1, c.query_index).view(bsz * n, g * block, 1)
            s, qc, keys = _scores(c, qb, kb, scale, block, rpe_b, kpm_b, kpm_mode, am_b, am_mode,
                                  shift=None if biased else row_lse)
            p = (s.sub_(row_lse) if biased else s).exp_()  # [B*n, g*block, kc*block]
            gc = gb.index_select(1, c.query_index).view(bsz * n, g * block, d)
            values = vb.index_select(1, c.key_index).view(bsz * n, kc * block, d)
            dv.index_add_(1, c.key_index, torch.bmm(p.transpose(1, 2), gc).view(bsz, n * kc, block * d))
            row_delta = delta.index_select(1, c.query_index).view(bsz * n, g * block, 1)
            ds = torch.baddbmm(row_delta.neg(), gc, values.transpose(1, 2)).mul_(p)  # dL/d(scores + rpe)
            dq.index_copy_(1, c.query_index, torch.bmm(ds, keys).mul_(scale).view(bsz, n * g, block * d))
            dk.index_add_(1, c.key_index, torch.bmm(ds.transpose(1, 2), qc).view(bsz, n * kc, block * d))
            if drpe is not None:
                pair_index = ((c.heads[:, None, None] * nb + c.rows[:, :, None]) * nb + c.cols[:, None, :])
                drpe.index_add_(1, pair_index.reshape(-1), ds.reshape(bsz, n, g, block, kc, block).transpose(
                    3, 4).reshape(bsz, n * g * kc, block, block))
        if drpe is not None:
            drpe = drpe.reshape(bsz, heads, nb, nb, block, block).transpose(3, 4).reshape(bsz, heads, length, length)
            drpe = drpe.sum_to_size(ctx.rpe_shape)
        return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), drpe,
                None, None, None, None, None, None, None)


def _rpe_blocks(rpe: torch.Tensor | None, block: int) -> torch.Tensor | None:
    """rpe (broadcastable to ``[B, H, L, L]``) -> ``[Br, Hr, nb, nb, block, block]`` view."""
    if rpe is None:
        return None
    return _pair_blocks(rpe[(None,) * (4 - rpe.dim())], block)


def block_sparse_attention(query, key, value, plan: BlockPlan, scale: float, rpe=None, key_padding_mask=None,
                           attn_mask=None, key_padding_mask_mode="add", attn_mask_mode="mul",
                           chunk_elements: int = DEFAULT_CHUNK_ELEMENTS):
    """``masked_dense_attention`` computed over ``plan``'s blocks only (same arguments, the layout as a
    ``BlockPlan``); differentiable in query, key, value and rpe (the masks are constants, as in DeepSpeed).

    query/key/value ``[B, H, L, D]`` with ``L = plan.num_blocks * plan.block``; key_padding_mask ``[B, L]``;
    attn_mask ``[L, L]``; rpe broadcastable to ``[B, H, L, L]``. Computes in at least float32, returns value's dtype.
    """
    bsz, heads, length, _ = query.shape
    if (heads, length) != (plan.num_heads, plan.num_blocks * plan.block):
        raise ValueError(f"query [B, H, L, D] = {list(query.shape)} does not fit the layout: {plan.num_heads} heads, "
                         f"L = {plan.num_blocks} blocks x {plan.block}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be a positive number of scores, got {chunk_elements}")
    dtype = torch.promote_types(query.dtype, torch.float32)
    if rpe is not None:
        if rpe.dim() > 4 or rpe.shape[-2:] != (length, length):
            raise ValueError(f"rpe must be broadcastable to [B, H, L, L] = {[bsz, heads, length, length]}, got "
                             f"{list(rpe.shape)}")
        rpe = rpe.to(dtype)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (bsz, length):
            raise ValueError(f"key_padding_mask must be [B, L] = {[bsz, length]}, got {list(key_padding_mask.shape)}")
        key_padding_mask = key_padding_mask.detach().to(dtype)
    if attn_mask is not None:
        if attn_mask.shape != (length, length):
            raise ValueError(f"attn_mask must be [L, L] = {[length, length]}, got {list(attn_mask.shape)}")
        attn_mask = attn_mask.detach().to(dtype)
    out = _BlockSparseAttention.apply(query.to(dtype), key.to(dtype), value.to(dtype), rpe, key_padding_mask,
                                      attn_mask, plan, float(scale), key_padding_mask_mode, attn_mask_mode,
                                      int(chunk_elements))
    return out.to(value.dtype)

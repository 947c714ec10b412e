"""Block-sparse attention layouts, pattern for pattern the ones of ``deepspeed.ops.sparse_attention``.

A layout is an int64 tensor ``[num_heads, num_blocks, num_blocks]``: entry ``[h, r, c]`` is 1 when the query
tokens of block row ``r`` attend to the key tokens of block column ``c`` in head ``h``. Random blocks are drawn
with Python's ``random.sample`` in DeepSpeed's order (per head, then per row), so ``random.seed(s)`` before
``make_layout`` gives DeepSpeed's layout for the same seed.
"""

from __future__ import annotations

import random

import torch

_ATTENTIONS = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> str:
    if attention not in _ATTENTIONS:
        raise ValueError(f"attention={attention!r}: accepted: {', '.join(_ATTENTIONS)} (only \"uni/bi-directional\" "
                         "attentions are supported)")
    return attention


def _check_global_ranges(starts: list[int], ends: list[int] | None) -> list[int] | None:
    if ends is None:
        return None
    if len(starts) != len(ends):
        raise ValueError(f"Global block start indices length, {len(starts)}, must be same as global block end "
                         f"indices length, {len(ends)}!")
    for start, end in zip(starts, ends, strict=True):
        if start >= end:
            raise ValueError(f"Global block start index, {start}, must be smaller than global block end index, "
                             f"{end}!")
    return ends


def _set_window(layout: torch.Tensor, h: int, start: int, end: int, unidirectional: bool) -> None:
    """Blocks ``start..end`` (exclusive) attend to each other (lower triangle only when unidirectional)."""
    for row in range(start, end):
        layout[h, row, start:(row + 1 if unidirectional else end)] = 1


def _set_sliding_window(layout: torch.Tensor, h: int, window: int, unidirectional: bool = False) -> None:
    num_blocks = layout.shape[1]
    if num_blocks < window:
        raise ValueError(f"Number of sliding window blocks, {window}, must be smaller than overall number of "
                         f"blocks in a row, {num_blocks}!")
    w = window // 2
    for row in range(num_blocks):
        end = row + 1 if unidirectional else min(row + w + 1, num_blocks)
        layout[h, row, max(0, row - w):end] = 1


def _check_random_blocks(num_blocks: int, num_random_blocks: int) -> None:
    if num_blocks < num_random_blocks:
        raise ValueError(f"Number of random blocks, {num_random_blocks}, must be smaller than overall number of "
                         f"blocks in a row, {num_blocks}!")


class SparsityConfig:
    """Shared properties of the block-sparse patterns: head count, block size (tokens), one layout or one per head."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len):
        """An all-zero ``[num_heads, seq_len // block, seq_len // block]`` int64 layout."""
        if seq_len % self.block != 0:
            raise ValueError(f"Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}!")
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout):
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:self.num_heads, :, :] = layout[0, :, :]
        return layout

    def make_layout(self, seq_len):
        raise NotImplementedError(
            f"{type(self).__name__} has no pattern; use DenseSparsityConfig, FixedSparsityConfig, "
            "VariableSparsityConfig, BigBirdSparsityConfig, BSLongformerSparsityConfig or "
            "LocalSlidingWindowSparsityConfig")


class DenseSparsityConfig(SparsityConfig):
    """Every block is attended: not sparse, kept for comparison."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        super().__init__(num_heads, block, different_layout_per_head)

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        layout[:, :, :] = 1
        return layout


class FixedSparsityConfig(SparsityConfig):
    """`Fixed` pattern of Sparse Transformers (arXiv:1904.10509), as customized by DeepSpeed.

    Local windows of ``num_local_blocks`` blocks; the last ``num_global_blocks`` of each window (for head h with
    several patterns: the window's ``(1 + h % num_different_global_patterns)``-th group from the end) are global
    columns, and also global rows with ``horizontal_global_attention``.
    """

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_local_blocks=4,
                 num_global_blocks=1, attention='bidirectional', horizontal_global_attention=False,
                 num_different_global_patterns=1):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = num_local_blocks
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"Number of blocks in a local window, {num_local_blocks}, must be dividable by number "
                             f"of global blocks, {num_global_blocks}!")
        self.num_global_blocks = num_global_blocks
        self.attention = _check_attention(attention)
        if attention != 'bidirectional' and horizontal_global_attention:
            raise ValueError('only "bi-directional" attentions can support horizontal global attention!')
        self.horizontal_global_attention = horizontal_global_attention
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("Number of different layouts cannot be more than one when you have set a single layout "
                             "for all heads! Set different_layout_per_head to True.")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(
                f"Number of layout versions (num_different_global_patterns), {num_different_global_patterns}, cannot "
                f"be larger than number of local window blocks divided by number of global blocks, "
                f"{num_local_blocks} / {num_global_blocks} = {num_local_blocks // num_global_blocks}!")
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h, layout):
        num_blocks = layout.shape[1]
        for i in range(0, num_blocks, self.num_local_blocks):
            _set_window(layout, h, i, min(i + self.num_local_blocks, num_blocks), self.attention == 'unidirectional')
        return layout

    def _set_global_group(self, h, layout, start, end):
        first_row = 0 if self.attention == 'bidirectional' else start
        layout[h, first_row:, start:end] = 1
        if self.horizontal_global_attention:
            layout[h, start:end, :] = 1

    def set_global_layout(self, h, layout):
        num_blocks = layout.shape[1]
        first = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        full_end = num_blocks - (num_blocks % self.num_local_blocks)
        for i in range(first, full_end, self.num_local_blocks):
            self._set_global_group(h, layout, i, i + self.num_global_blocks)
        if full_end < num_blocks:  # a short last window still gets its global group (clamped inside it)
            start = min(full_end + first, num_blocks - self.num_global_blocks)
            self._set_global_group(h, layout, start, start + self.num_global_blocks)
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """`Fixed` extended with random blocks, a list of local window sizes and explicit global block indices/ranges."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=0,
                 local_window_blocks=[4], global_block_indices=[0], global_block_end_indices=None,  # noqa: B006
                 attention='bidirectional', horizontal_global_attention=False):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = local_window_blocks
        self.global_block_indices = global_block_indices
        self.global_block_end_indices = _check_global_ranges(global_block_indices, global_block_end_indices)
        self.attention = _check_attention(attention)
        if attention != 'bidirectional' and horizontal_global_attention:
            raise ValueError('only "bi-directional" attentions can support horizontal global attention!')
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h, layout):
        num_blocks = layout.shape[1]
        _check_random_blocks(num_blocks, self.num_random_blocks)
        for row in range(num_blocks):
            layout[h, row, random.sample(range(0, num_blocks), self.num_random_blocks)] = 1
        return layout

    def set_local_layout(self, h, layout):
        num_blocks = layout.shape[1]
        uni = self.attention == 'unidirectional'
        start = 0
        size = self.local_window_blocks[-1]
        for size in self.local_window_blocks:
            _set_window(layout, h, start, min(start + size, num_blocks), uni)
            start += size
        for i in range(start, num_blocks, size):  # the last size repeats over the rest
            _set_window(layout, h, i, min(i + size, num_blocks), uni)
        return layout

    def _global_ranges(self):
        if self.global_block_end_indices is None:
            return [(i, i + 1) for i in self.global_block_indices]
        return list(zip(self.global_block_indices, self.global_block_end_indices, strict=True))

    def set_global_layout(self, h, layout):
        num_blocks = layout.shape[1]
        for start, end in self._global_ranges():
            if start >= num_blocks:
                continue
            end = min(end, num_blocks)
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            layout[h, (0 if self.attention == 'bidirectional' else start):, start:end] = 1
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (arXiv:2007.14062): random blocks, a sliding window and the first blocks global (rows and columns)."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=1,
                 num_sliding_window_blocks=3, num_global_blocks=1, attention='bidirectional'):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = _check_attention(attention)

    def set_random_layout(self, h, layout):
        num_blocks = layout.shape[1]
        _check_random_blocks(num_blocks, self.num_random_blocks)
        for row in range(num_blocks):
            sample_range = range(0, num_blocks) if self.attention == 'bidirectional' else range(0, row + 1)
            layout[h, row, random.sample(sample_range, self.num_random_blocks)] = 1
        return layout

    def set_sliding_window_layout(self, h, layout):
        _set_sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout_itc(self, h, layout):
        num_blocks = layout.shape[1]
        if num_blocks < self.num_global_blocks:
            raise ValueError(f"Number of global blocks, {self.num_global_blocks}, must be smaller than overall "
                             f"number of blocks in a row, {num_blocks}!")
        layout[h, 0:self.num_global_blocks, :] = 1
        layout[h, :, 0:self.num_global_blocks] = 1
        if self.attention == 'unidirectional':
            layout = torch.tril(layout)  # nothing attends to the future
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            layout = self.set_random_layout(h, layout)
            layout = self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout_itc(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (arXiv:2004.05150): a sliding window plus global blocks (rows and columns)."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_sliding_window_blocks=3,
                 global_block_indices=[0], global_block_end_indices=None,  # noqa: B006
                 attention='bidirectional'):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = global_block_indices
        self.attention = attention
        self.global_block_end_indices = _check_global_ranges(global_block_indices, global_block_end_indices)

    def set_sliding_window_layout(self, h, layout):
        _set_sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout(self, h, layout):
        num_blocks = layout.shape[1]
        if self.global_block_end_indices is None:
            ranges = [(i, i + 1) for i in self.global_block_indices]
        else:
            ranges = list(zip(self.global_block_indices, self.global_block_end_indices, strict=True))
        for start, end in ranges:
            if start < num_blocks:
                end = min(end, num_blocks)
                layout[h, start:end, :] = 1
                layout[h, :, start:end] = 1
        if self.attention == 'unidirectional':
            layout = torch.tril(layout)
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            layout = self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window of ``num_sliding_window_blocks`` blocks (causal by default)."""

    def __init__(self, num_heads, block=16, num_sliding_window_blocks=3, attention='unidirectional'):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h, layout):
        _set_sliding_window(layout, h, self.num_sliding_window_blocks, self.attention != "bidirectional")
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)

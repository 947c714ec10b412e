"""``deepspeed.runtime.sparse_tensor``: DeepSpeed's row-sparse gradient (TensorFlow's ``IndexedSlices``).

A gradient of an embedding table touches a few rows. ``SparseTensor`` holds it as the touched row ``indices`` and
their ``values`` (one row each, ``values.shape == (len(indices), *dense_size[1:])``), built from a torch sparse COO
gradient (``nn.Embedding(sparse=True)``: coalesced, duplicates summed) or, as DeepSpeed before 0.19 allowed, from a
dense tensor (its non-zero rows). DeepSpeed's engine all-gathers indices and values instead of reducing the whole
table; this engine averages sparse gradients densely (the same numbers, more traffic for large tables).
Indices may repeat after ``add``; ``to_dense`` and ``to_coo_tensor`` sum repeated rows.
"""

from __future__ import annotations

import torch

__all__ = ["SparseTensor"]


class SparseTensor:
    """Compressed (row-sparse) tensor."""

    def __init__(self, dense_tensor: torch.Tensor | None = None) -> None:
        self.orig_dense_tensor = dense_tensor
        self.is_sparse = dense_tensor is not None and dense_tensor.is_sparse
        self.indices: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.dense_size: list[int] | None = None
        if dense_tensor is None:
            return
        self.dtype = dense_tensor.dtype
        if dense_tensor.is_sparse:
            if dense_tensor.sparse_dim() != 1:
                raise ValueError(f"SparseTensor needs a row-sparse tensor (sparse_dim 1, as an embedding gradient); "
                                 f"got sparse_dim {dense_tensor.sparse_dim()} of shape {tuple(dense_tensor.shape)}")
            coalesced = dense_tensor.coalesce()
            self.indices = coalesced.indices().flatten()
            self.values = coalesced.values()
        else:
            if dense_tensor.dim() < 2:
                raise ValueError(f"SparseTensor needs rows: a tensor of 2 or more dimensions, got shape "
                                 f"{tuple(dense_tensor.shape)}")
            rows = dense_tensor.reshape(dense_tensor.shape[0], -1).ne(0).any(dim=1)
            self.indices = rows.nonzero().flatten()
            self.values = dense_tensor[self.indices]
        self.dense_size = list(dense_tensor.size())

    def to_coo_tensor(self) -> torch.Tensor:
        """A torch sparse COO tensor (sparse rows, dense columns) of the same values."""
        return torch.sparse_coo_tensor(self.indices.unsqueeze(0), self.values, self.dense_size, check_invariants=False)

    @staticmethod
    def type() -> str:
        return "deepspeed.SparseTensor"

    def to_dense(self) -> torch.Tensor:
        """The dense tensor (repeated indices summed)."""
        return self.values.new_zeros(self.dense_size).index_add_(0, self.indices, self.values)

    def sparse_size(self) -> tuple[int, int]:
        """``(elements held: indices + values, elements of the dense tensor)``."""
        held = self.indices.numel() + self.values.numel()
        dense = 1
        for size in self.dense_size:
            dense *= size
        return held, dense

    def add(self, b: SparseTensor) -> None:
        """Append ``b``'s rows (same dense size): the sum, with indices possibly repeated."""
        if self.dense_size != b.dense_size:
            raise ValueError(f"SparseTensor.add: dense sizes differ ({self.dense_size} vs {b.dense_size})")
        self.indices = torch.cat([self.indices, b.indices])
        self.values = torch.cat([self.values, b.values])

    def __str__(self) -> str:
        sparse_size, dense_size = self.sparse_size()
        return (f"DeepSpeed.SparseTensor(indices_size={self.indices.size()}, values_size={self.values.size()}, "
                f"dense_size={self.dense_size}, device={self.indices.get_device()}, "
                f"reduction_factor={dense_size / sparse_size if sparse_size else float('inf')})")

    def __repr__(self) -> str:
        return self.__str__()

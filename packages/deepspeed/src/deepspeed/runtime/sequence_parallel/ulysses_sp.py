"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: Arctic Long Sequence Training (ALST), DeepSpeed's module path.

- ``UlyssesSPAttentionHF`` (``ulysses_attention``): Ulysses sequence parallelism inside Hugging Face Transformers'
  attention, installed by ``UlyssesSPAttentionHF.register_with_transformers``.
- ``UlyssesSPDataLoaderAdapter`` (``sp_dataloader``): shards each batch's sequence over the sequence-parallel group.
- ``TiledMLP``, ``SequenceTiledCompute`` / ``sequence_tiled_compute``, ``TiledFusedLogitsLoss``, ``TiledLoss``
  (``tiled_compute``): sequence-tiled computation that keeps one tile's activations alive.

See docs/alst.md.
"""

from deepspeed.runtime.sequence_parallel.sp_dataloader import UlyssesSPDataLoaderAdapter
from deepspeed.runtime.sequence_parallel.tiled_compute import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledLoss,
    TiledMLP,
    sequence_tiled_compute,
)
from deepspeed.runtime.sequence_parallel.ulysses_attention import UlyssesSPAttentionHF

__all__ = [
    "SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledLoss", "TiledMLP", "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute",
]

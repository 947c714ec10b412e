"""DeepSpeed's checkpoint layout: file names, tags, the ``latest`` file and which rank writes what.

``<save_dir>/latest`` holds the current tag; ``<save_dir>/<tag>/`` holds ``mp_rank_XX_model_states.pt``
(module, optimizer, scheduler, counters, config), ``zero_pp_rank_<r>_mp_rank_XX_optim_states.pt`` (ZeRO's
per-rank optimizer shards) and, for pipeline models, ``layer_XX-model_YY-model_states.pt``. Keeping these
names lets DeepSpeed's own tools (``zero_to_fp32.py``, universal checkpoint converters) read our files.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from deepspeed.runtime.checkpointing.errors import CheckpointTagError, CorruptCheckpointError

if TYPE_CHECKING:
    from deepspeed.runtime.checkpointing._state import ParallelInfo
    from ds_config.checkpoint import CheckpointConfig

LATEST_FILE = "latest"


def default_tag(global_steps: int) -> str:
    """DeepSpeed's default tag: ``global_step<N>``."""
    return f"global_step{global_steps}"


def validate_tag(tag: object) -> str:
    """``str(tag)`` (as DeepSpeed does) after checking it names one directory inside the save directory."""
    text = str(tag)
    bad = not text or text.strip() != text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text
    if bad:
        raise CheckpointTagError(
            f"checkpoint tag {text!r} is not usable as a directory name; use a non-empty name without path "
            "separators or surrounding spaces, e.g. 'global_step14'"
        )
    return text


def model_states_name(mp_rank: int = 0) -> str:
    """``mp_rank_XX_model_states.pt``: module, optimizer, scheduler, counters and config of one model-parallel rank."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero_optim_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    """``zero_pp_rank_<dp>_mp_rank_XX_optim_states.pt``: one data-parallel rank's ZeRO optimizer shard."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def layer_states_name(layer: int, mp_rank: int = 0) -> str:
    """``layer_XX-model_YY-model_states.pt``: one pipeline layer's weights."""
    return f"layer_{layer:02d}-model_{mp_rank:02d}-model_states.pt"


def pipeline_layer_range(num_layers: int, dp_rank: int, dp_world_size: int, parallel_write: bool) -> range:
    """The pipeline layers this data-parallel rank writes (``checkpoint.parallel_write.pipeline_stage``).

    Off: data-parallel rank 0 writes every layer of its stage. On: the stage's layers are split into
    ``dp_world_size`` contiguous, near-equal runs, one per data-parallel rank, so a stage writes in parallel.
    """
    if num_layers < 0 or dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"pipeline_layer_range: bad arguments num_layers={num_layers}, dp_rank={dp_rank}, "
                         f"dp_world_size={dp_world_size}")
    if not parallel_write:
        return range(num_layers) if dp_rank == 0 else range(0)
    base, extra = divmod(num_layers, dp_world_size)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (1 if dp_rank < extra else 0))


def writer_rank(config: CheckpointConfig, parallel: ParallelInfo) -> int:
    """The rank number that decides who writes model states and ``latest``: 0 writes.

    DeepSpeed's rule: the data-parallel rank, or the local rank with ``use_node_local_storage`` (then the
    first process of every node writes, so each node's disk holds a complete checkpoint).
    """
    return parallel.local_rank if config.use_node_local_storage else parallel.dp_rank


def latest_writer(config: CheckpointConfig, parallel: ParallelInfo) -> bool:
    """Whether this process writes ``latest``: global rank 0, or local rank 0 of each node with node-local storage."""
    return (parallel.local_rank if config.use_node_local_storage else parallel.global_rank) == 0


def read_latest(load_dir: str | os.PathLike, name: str = LATEST_FILE) -> str | None:
    """The tag in ``<load_dir>/latest`` (stripped), or None when the file does not exist.

    A file that holds no usable tag (empty, not UTF-8 text, a path) raises :class:`CorruptCheckpointError`
    naming it, rather than a ``UnicodeDecodeError`` or a tag that silently loads nothing.
    """
    path = os.path.join(load_dir, name)
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        return None
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise _bad_tag_file(path, f"not a tag file ({len(raw)} bytes, not UTF-8 text)") from None
    if not text:
        raise _bad_tag_file(path, f"empty file ({len(raw)} bytes; a tag name was expected)")
    try:
        return validate_tag(text)
    except CheckpointTagError:
        raise _bad_tag_file(path, f"not a tag file (holds {text[:60]!r}, not a directory name)") from None


def _bad_tag_file(path: str, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {reason}", path=path, reason=reason)

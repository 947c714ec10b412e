"""``sparse_attention``: block-sparse self-attention layouts (dense, fixed, variable, bigbird, bslongformer).

Each mode reads its own subset of the keys; a key that belongs to another mode is an error that names the
mode and what it accepts, unless it is written with its documented default (the reference's own example
lists every key under ``"fixed"``, and such a key changes nothing).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from ds_config._base import AUTO, DSConfigModel
from ds_config._errors import _MISSING, ConfigError, ConfigProblem, join_path

SparseMode = Literal["dense", "fixed", "variable", "bigbird", "bslongformer"]

_COMMON = ("block", "different_layout_per_head")

#: keys each mode reads (besides ``mode``), in the order the reference lists them
MODE_FIELDS: dict[str, tuple[str, ...]] = {
    "dense": _COMMON,
    "fixed": _COMMON + ("num_local_blocks", "num_global_blocks", "attention", "horizontal_global_attention",
                        "num_different_global_patterns"),
    "variable": _COMMON + ("num_random_blocks", "local_window_blocks", "global_block_indices",
                           "global_block_end_indices", "attention", "horizontal_global_attention"),
    "bigbird": _COMMON + ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"),
    "bslongformer": _COMMON + ("num_sliding_window_blocks", "global_block_indices", "global_block_end_indices"),
}


def _error_at(where: str | tuple, message: str, value: Any = _MISSING, **ctx: Any) -> ConfigError:
    """A ``ConfigError`` at ``where`` (a key path relative to the model being validated; the base class
    prefixes the section's path). ``message`` is formatted with ``ctx``."""
    path = join_path(*where) if isinstance(where, tuple) else where
    return ConfigError(ConfigProblem(path, message.format(**ctx), value))


class SparseAttentionConfig(DSConfigModel):
    """The ``sparse_attention`` section; ``mode`` picks the layout and the keys that apply."""

    MODE_FIELDS: ClassVar[dict[str, tuple[str, ...]]] = MODE_FIELDS

    mode: SparseMode = "fixed"
    """Sparsity structure: dense, fixed, variable, bigbird or bslongformer."""
    block: int = Field(16, ge=1)
    """Block size: attention is computed on ``block x block`` tiles."""
    different_layout_per_head: bool = False
    """Give each head its own layout (as far as the mode allows)."""
    num_local_blocks: int = Field(4, ge=1)
    """Blocks in each local window (fixed)."""
    num_global_blocks: int = Field(1, ge=1)
    """Consecutive blocks of a local window that represent it globally (fixed, bigbird)."""
    attention: Literal["unidirectional", "bidirectional"] = "bidirectional"
    """Unidirectional (autoregressive) or bidirectional (BERT-like) attention (fixed, variable)."""
    horizontal_global_attention: bool = False
    """Global blocks also attend to every block; bidirectional only (fixed, variable)."""
    num_different_global_patterns: int = Field(1, ge=1)
    """Number of distinct global layouts across heads (fixed)."""
    num_random_blocks: int = Field(0, ge=0)
    """Random blocks per block row (variable, bigbird)."""
    local_window_blocks: list[int] = Field(default_factory=lambda: [4], min_length=1)
    """Blocks per local window; the last entry repeats for the remaining windows (variable)."""
    global_block_indices: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """Global block indices, or window starts when ``global_block_end_indices`` is set (variable, bslongformer)."""
    global_block_end_indices: list[int] | None = None
    """Exclusive ends of the global windows, same length as ``global_block_indices`` (variable, bslongformer)."""
    num_sliding_window_blocks: int = Field(3, ge=1)
    """Blocks in the sliding local window (bigbird, bslongformer)."""

    @model_validator(mode="before")
    @classmethod
    def _keys_of_mode(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        mode = data.get("mode", "fixed")
        if mode == AUTO:
            mode = "fixed"
        if not isinstance(mode, str) or mode not in MODE_FIELDS:
            return data  # the Literal on ``mode`` reports it
        accepted = ("mode",) + MODE_FIELDS[mode]
        for key, value in data.items():
            if key in accepted or key not in cls.model_fields:
                continue  # unknown keys are the base class's job (did-you-mean)
            if value == AUTO or value == _default_of(cls, key):
                continue  # another mode's key at its default changes nothing (the reference example has them)
            raise _error_at(key, "'{key}' is not used by sparse attention mode '{mode}'; mode '{mode}' accepts: "
                            "{accepted}", value, key=key, mode=mode, accepted=", ".join(accepted))
        return data

    @model_validator(mode="after")
    def _consistent(self) -> SparseAttentionConfig:
        uses = MODE_FIELDS[self.mode]
        if "horizontal_global_attention" in uses and self.horizontal_global_attention \
                and self.attention != "bidirectional":
            raise _error_at("horizontal_global_attention",
                            "horizontal global attention needs attention 'bidirectional' (attention is '{att}')",
                            True, att=self.attention)
        if self.mode == "fixed":
            self._check_fixed()
        ends = self.global_block_end_indices
        if "global_block_end_indices" in uses and ends is not None:
            starts = self.global_block_indices
            if len(ends) != len(starts):
                raise _error_at("global_block_end_indices",
                                "must have the same length as global_block_indices ({n} entries)", ends,
                                n=len(starts))
            if any(s >= e for s, e in zip(starts, ends, strict=True)):
                raise _error_at("global_block_end_indices",
                                "each end index must be greater than its start in global_block_indices {starts}",
                                ends, starts=starts)
        return self

    def _check_fixed(self) -> None:
        if self.num_local_blocks % self.num_global_blocks:
            raise _error_at("num_global_blocks", "num_local_blocks ({local}) must be divisible by num_global_blocks",
                            self.num_global_blocks, local=self.num_local_blocks)
        patterns = self.num_different_global_patterns
        if patterns > 1 and not self.different_layout_per_head:
            raise _error_at("num_different_global_patterns",
                            "more than one global pattern needs different_layout_per_head true", patterns)
        most = self.num_local_blocks // self.num_global_blocks
        if patterns > most:
            raise _error_at("num_different_global_patterns",
                            "at most num_local_blocks // num_global_blocks = {most} patterns are possible",
                            patterns, most=most)

    def layout_params(self) -> dict[str, Any]:
        """The keys the chosen mode uses, with their values (the sparsity layout's constructor arguments)."""
        return {name: getattr(self, name) for name in MODE_FIELDS[self.mode]}


def _default_of(cls: type[DSConfigModel], name: str) -> Any:
    return cls.model_fields[name].get_default(call_default_factory=True)

"""Megatron's 2D (pipeline x tensor) rank layout and its contraction: which source ranks' files each rank of a
smaller layout reads (``meg_2d_parallel_map``, ``reshape_meg_2d_parallel``, as DeepSpeed names them).

Source ranks are numbered pipeline-major: rank ``i`` is pipeline stage ``i // tp`` and tensor slice ``i % tp``
(the order of a checkpoint's ``mp_rank_XX`` files). Contraction merges neighbours: tensor slices first (each
new slice takes a consecutive run of old ones within its stage), then pipeline stages likewise.
"""

from __future__ import annotations

from typing import Any

from deepspeed.checkpoint.reshape_utils import partition_data


class meg_2d_parallel_map:  # noqa: N801 - DeepSpeed's class name
    """``(pp_index, tp_index) -> list of source indices`` for a ``pp_degree x tp_degree`` layout."""

    def __init__(self, pp_degree: int, tp_degree: int) -> None:
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map: dict[str, list[Any]] = {}

    def simple_init(self) -> None:
        """Each position holds its own source rank (pipeline-major numbering)."""
        self.map = {self._make_key(i // self.tp_degree, i % self.tp_degree): [i]
                    for i in range(self.pp_degree * self.tp_degree)}

    def add_data(self, pp_index: int, tp_index: int, data: list[Any]) -> None:
        self._validate_indices(pp_index, tp_index)
        if not isinstance(data, list):
            raise AssertionError(f"meg_2d_parallel_map.add_data: data must be a list, got {type(data).__name__}")
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list[Any]:
        """The entries at one position, or concatenated over every stage / slice where an index is None."""
        self._validate_indices(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [item for i in pps for j in tps for item in self.map.get(self._make_key(i, j), [])]

    def print_data(self, tag: str) -> None:
        print(tag)
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index: int | None, tp_index: int | None) -> None:
        if pp_index is not None and not 0 <= pp_index < self.pp_degree:
            raise AssertionError(f"pp_index {pp_index} is outside pp_degree {self.pp_degree}")
        if tp_index is not None and not 0 <= tp_index < self.tp_degree:
            raise AssertionError(f"tp_index {tp_index} is outside tp_degree {self.tp_degree}")

    @staticmethod
    def _make_key(i: int, j: int) -> str:
        return f"{i},{j}"


def _reshape_tp_dimension(old: meg_2d_parallel_map, new_tp_degree: int) -> meg_2d_parallel_map:
    new = meg_2d_parallel_map(old.pp_degree, new_tp_degree)
    for pp in range(old.pp_degree):
        for tp, part in enumerate(partition_data(old.get_data(pp_index=pp), new_tp_degree)):
            new.add_data(pp, tp, list(part))
    return new


def _reshape_pp_dimension(old: meg_2d_parallel_map, new_pp_degree: int) -> meg_2d_parallel_map:
    new = meg_2d_parallel_map(new_pp_degree, old.tp_degree)
    for tp in range(old.tp_degree):
        for pp, part in enumerate(partition_data(old.get_data(tp_index=tp), new_pp_degree)):
            new.add_data(pp, tp, list(part))
    return new


def reshape_meg_2d_parallel(old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int,
                            verbose: bool = False) -> meg_2d_parallel_map:
    """The source ranks each position of the ``new_pp_degree x new_tp_degree`` layout takes (contraction only:
    each new degree at most the old one, and dividing it)."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise AssertionError(f"reshape_meg_2d_parallel: only contraction is supported, got pp {old_pp_degree} -> "
                             f"{new_pp_degree}, tp {old_tp_degree} -> {new_tp_degree}")
    result = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    result.simple_init()
    if verbose:
        result.print_data("original_2d_map:")
    if old_tp_degree != new_tp_degree:
        result = _reshape_tp_dimension(result, new_tp_degree)
    if verbose:
        result.print_data("after_tp_reshape:")
    if old_pp_degree != new_pp_degree:
        result = _reshape_pp_dimension(result, new_pp_degree)
    if verbose:
        result.print_data("final_2d_map:")
    return result

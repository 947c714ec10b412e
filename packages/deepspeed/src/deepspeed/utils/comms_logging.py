"""Records of the collectives launched through ``deepspeed.comm`` (the ``comms_logger`` config section).

Per operation name and message size: call count, latencies (ms), algorithm bandwidth and bus bandwidth (Gbps).
Message size is the bytes this rank contributes: the input of gathers and all-to-all, the output shard of
reduce-scatter, the tensor otherwise. Bus bandwidth follows the NCCL-tests convention DeepSpeed reports: the
algorithm bandwidth scaled by the share of the data that must cross the wire for that collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deepspeed.utils.logging import log_dist

_GATHER_LIKE = {"all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"}
_ALL_REDUCE_LIKE = {"all_reduce", "all_reduce_coalesced", "inference_all_reduce"}
_POINT_LIKE = {"send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "reduce", "gather", "scatter",
               "barrier"}
_ALL_TO_ALL = {"all_to_all_single", "all_to_all"}
KNOWN_OPS = _GATHER_LIKE | _ALL_REDUCE_LIKE | _POINT_LIKE | _ALL_TO_ALL


def calc_bw_log(comm_op: str, size: int, duration: float, world_size: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in Gbps for ``size`` bytes moved by ``comm_op`` in ``duration`` ms."""
    if comm_op not in KNOWN_OPS:
        raise ValueError(f"calc_bw_log: unknown comm_op {comm_op!r}; known: {sorted(KNOWN_OPS)}")
    n = max(world_size, 1)
    duration = max(duration, 1e-9)  # a zero-time op would divide by zero; report its bandwidth as huge
    if comm_op in _ALL_TO_ALL:
        algbw = size / duration
        busbw = algbw * (n - 1) / n
    elif comm_op in _GATHER_LIKE:
        algbw = size * n / duration  # the whole gathered (or scattered) buffer
        busbw = algbw * (n - 1) / n
    elif comm_op in _ALL_REDUCE_LIKE:
        algbw = 2 * size / duration  # reduce-scatter then all-gather: every byte crosses twice
        busbw = (size / duration) * 2 * (n - 1) / n
    else:
        algbw = busbw = size / duration
    # bytes per ms -> Gbit per s: * 8 bits * 1e3 ms/s / 1e9
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def convert_size(size_bytes: int) -> str:
    """Human-readable size in binary units: ``4096`` -> ``"4.0 KB"``."""
    if size_bytes <= 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(size_bytes, 1024))), len(names) - 1)
    return f"{round(size_bytes / 1024**i, 2)} {names[i]}"


@dataclass
class SizeRecord:
    """All calls of one operation with one message size."""

    count: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    algbws: list[float] = field(default_factory=list)
    busbws: list[float] = field(default_factory=list)


def _record(vals: Any) -> SizeRecord:
    """A ``comms_dict`` entry as a record: ours, or DeepSpeed's ``[count, latencies, algbws, busbws]`` list
    (code that fills ``comms_dict`` itself, as DeepSpeed's tests do)."""
    if isinstance(vals, SizeRecord):
        return vals
    count, latencies, algbws, busbws = vals
    return SizeRecord(int(count), list(latencies), list(algbws), list(busbws))


class CommsLogger:
    """Collects per-op records when enabled; ``configure`` takes the typed ``CommsLoggerConfig``."""

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.debug = False
        self.prof_ops: list[str] = []
        self.comms_dict: dict[str, dict[int, SizeRecord]] = {}

    def configure(self, comms_config: Any) -> None:
        """Apply a ``ds_config.CommsLoggerConfig`` (the ``comms_logger`` section)."""
        for key in ("enabled", "verbose", "prof_all", "debug", "prof_ops"):
            if not hasattr(comms_config, key):
                raise TypeError(
                    f"CommsLogger.configure: expected a CommsLoggerConfig, got {type(comms_config).__name__}"
                )
        self.enabled = bool(comms_config.enabled)
        self.verbose = bool(comms_config.verbose)
        self.prof_all = bool(comms_config.prof_all)
        self.debug = bool(comms_config.debug)
        self.prof_ops = list(comms_config.prof_ops)

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in set(op_name_list)]

    def should_profile(self, op_name: str, prof: bool = False) -> bool:
        """Logging on, and this op selected (``prof_all``, listed in ``prof_ops``, or ``prof=True`` at the call)."""
        return self.enabled and (self.prof_all or prof or op_name in self.prof_ops)

    def append(self, raw_name: str, record_name: str, latency_ms: float, msg_size: int, world_size: int) -> None:
        """Record one call; ``raw_name`` picks the bandwidth formula, ``record_name`` is the table row."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency_ms, world_size)
        record = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, SizeRecord())
        record.count += 1
        record.latencies_ms.append(latency_ms)
        record.algbws.append(algbw)
        record.busbws.append(busbw)
        if self.verbose:
            log_dist(
                f"comm op: {record_name} | time (ms): {latency_ms:.2f} | msg size: {convert_size(msg_size)} "
                f"| algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}",
                ranks=[0],
            )

    def reset(self) -> None:
        self.comms_dict = {}

    reset_data = reset  # DeepSpeed's name

    def rows(self) -> list[tuple[str, int, SizeRecord]]:
        """(op, message size, record) in a stable order: ops by name, sizes ascending."""
        return [(op, size, _record(vals)) for op in sorted(self.comms_dict)
                for size, vals in sorted(self.comms_dict[op].items())]

    # ---- DeepSpeed's read API over the records --------------------------------------------------------------
    def get_raw_data(self) -> dict[str, dict[int, list]]:
        """Every record as DeepSpeed keeps it: ``{op: {msg_size: [count, latencies, algbws, busbws]}}`` (copies)."""
        out: dict[str, dict[int, list]] = {}
        for op, size, rec in self.rows():
            out.setdefault(op, {})[size] = [rec.count, list(rec.latencies_ms), list(rec.algbws), list(rec.busbws)]
        return out

    def has_data(self) -> bool:
        return any(rec.count for _, _, rec in self.rows())

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(rec.count for _, _, rec in self.rows())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """Per message size of ``operation_name``: count, total and trimmed-mean latency (10 % off each end, as
        DeepSpeed) and bandwidths; None when the operation was never recorded. The records are not reordered."""
        from deepspeed.utils.timer import trim_mean

        if operation_name not in self.comms_dict:
            return None
        summary = {}
        for size, vals in sorted(self.comms_dict[operation_name].items()):
            rec = _record(vals)
            summary[size] = {"count": rec.count, "total_latency_ms": sum(rec.latencies_ms),
                             "avg_latency_ms": trim_mean(rec.latencies_ms, 0.1),
                             "tput_avg_gbps": trim_mean(rec.algbws, 0.1), "busbw_avg_gbps": trim_mean(rec.busbws, 0.1),
                             "msg_size_bytes": size, "msg_size_str": convert_size(size)}
        return summary

    def summary_table(self, stragglers_ms: dict[tuple[str, int], float] | None = None) -> str:
        """The ``log_summary`` table; with ``stragglers_ms`` a column of total latency above the fastest rank."""
        columns = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                   "tput_avg (Gbps)", "busbw_avg (Gbps)"]
        if stragglers_ms is not None:
            columns.append("Straggler(ms)")
        lines = ["".join(f"{c: <20}" for c in columns)]
        current = None
        for op, size, rec in self.rows():
            if op != current:
                lines.append(op)
                current = op
            total = sum(rec.latencies_ms)
            cells = ["", convert_size(size), str(rec.count), f"{total:.2f}", f"{total / rec.count:.2f}",
                     f"{sum(rec.algbws) / rec.count:.2f}", f"{sum(rec.busbws) / rec.count:.2f}"]
            if stragglers_ms is not None:
                cells.append(f"{stragglers_ms[(op, size)]:.2f}")
            lines.append("".join(f"{c: <20}" for c in cells))
        return "\n".join(lines)

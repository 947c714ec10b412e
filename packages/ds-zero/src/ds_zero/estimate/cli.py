"""``ds-estimate``: print ZeRO-2/ZeRO-3 model-states memory tables from parameter counts or a HF config.

    ds-estimate --params 2851e6 --largest-layer 32e6 --gpus-per-node 8 --nodes 1 --stage 3
    ds-estimate --hf-config t5-3b --gpus-per-node 8        # counts the config on the meta device

Without ``--stage`` every stage the inputs allow is printed (ZeRO-3 needs the largest layer's size).
"""

from __future__ import annotations

import argparse
import json
import sys
from decimal import Decimal, InvalidOperation

from ds_zero.estimate._table import check_buffer_factor, check_positive_int
from ds_zero.estimate._zero2 import format_zero2_estimate
from ds_zero.estimate._zero3 import format_zero3_estimate

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_MAX_COUNT = 10**18  # far above any real model; keeps absurd exponents from building huge integers


def parse_count(text: str) -> int:
    """A parameter count from text: ``2851e6``, ``2851598336``, ``2.851B``, ``32M``, ``7_000_000`` (an exact
    non-negative integer; suffixes K, M, B/G, T are powers of 1000)."""
    cleaned = text.strip().replace("_", "")
    scale = _SUFFIXES.get(cleaned[-1:].lower(), 1)
    number = cleaned[:-1] if scale != 1 else cleaned
    try:
        value = Decimal(number) * scale  # Decimal, not float: "2.851B" must be exactly 2851000000
    except InvalidOperation:
        raise ValueError(f"not a parameter count: {text!r} (expected e.g. 2851e6, 2.851B, 32M)") from None
    if not value.is_finite() or value < 0 or value > _MAX_COUNT or value != value.to_integral_value():
        raise ValueError(f"not a parameter count: {text!r} (expected a whole number between 0 and 1e18)")
    return int(value)


def _count_arg(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``ds-estimate`` argument parser."""
    parser = argparse.ArgumentParser(prog="ds-estimate", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=_count_arg, help="total model parameters, e.g. 2851e6 or 2.851B")
    source.add_argument("--hf-config", metavar="NAME_OR_PATH",
                        help="Hugging Face config: a config.json, its directory, or a hub model name")
    parser.add_argument("--largest-layer", type=_count_arg, help="parameters of the largest layer (ZeRO-3)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="GPUs on each node (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--stage", type=int, choices=(2, 3), help="only this ZeRO stage (default: all possible)")
    parser.add_argument("--buffer-factor", type=float, default=1.5,
                        help="safety factor on CPU memory (default 1.5)")
    parser.add_argument("--hf-auto-class", default="AutoModel",
                        help="transformers Auto class that builds the model (default AutoModel)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow custom HF model code")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    return parser


def _resolve_counts(args: argparse.Namespace) -> tuple[int, int | None]:
    if args.hf_config is None:
        return args.params, args.largest_layer
    if args.largest_layer is not None:
        raise ValueError("--largest-layer cannot be combined with --hf-config (the config gives it)")
    from ds_zero.estimate._hf import hf_config_params  # transformers is optional: import only when asked

    counts = hf_config_params(args.hf_config, args.hf_auto_class, args.trust_remote_code)
    return counts.total_params, counts.largest_layer_params


def _stages(requested: int | None, largest: int | None) -> list[int]:
    if requested == 3 and largest is None:
        raise ValueError("--stage 3 needs --largest-layer (or --hf-config, which counts it)")
    if requested is not None:
        return [requested]
    return [2] if largest is None else [2, 3]


def run(args: argparse.Namespace) -> str:
    """The text ``ds-estimate`` prints for parsed ``args``; raises ValueError/ImportError on bad input."""
    gpus = check_positive_int("--gpus-per-node", args.gpus_per_node)
    nodes = check_positive_int("--nodes", args.nodes)
    factor = check_buffer_factor(args.buffer_factor)
    total, largest = _resolve_counts(args)
    tables, rows = [], {}
    for stage in _stages(args.stage, largest):
        if stage == 2:
            text, rows[stage] = format_zero2_estimate(total, gpus, nodes, factor)
        else:
            text, rows[stage] = format_zero3_estimate(total, largest, gpus, nodes, factor)
        tables.append(f"ZeRO-{stage}:\n{text}")
    if not args.json:
        return "\n\n".join(tables)
    return json.dumps({
        "total_params": total, "largest_layer_params": largest, "num_gpus_per_node": gpus, "num_nodes": nodes,
        "additional_buffer_factor": factor,
        "stages": {str(stage): [row.as_dict() for row in stage_rows] for stage, stage_rows in rows.items()},
    }, indent=2)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (0 ok, 2 bad arguments or input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors; report the code instead
        return exc.code if isinstance(exc.code, int) else 2
    try:
        print(run(args))
    except (ValueError, TypeError, ImportError, FileNotFoundError) as exc:
        print(f"ds-estimate: error: {exc}", file=sys.stderr)
        return 2
    return 0

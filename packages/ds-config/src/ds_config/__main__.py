"""Command line: ``python -m ds_config validate FILE [--world-size N] [--no-strict] [--print-resolved] [--json]``
and ``python -m ds_config schema``.

``validate`` prints a one-line verdict (``OK``, the batch sizes, the warning count); ``--print-resolved`` prints
the config with every default filled in instead (verdict on stderr), ``--json`` one JSON object for scripts.
Exit status: 0 valid, 1 invalid config, 2 usage error or unreadable file, 141 when stdout's reader closed the
pipe early (``python -m ds_config schema | head``: no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from ds_config._errors import ConfigError, ConfigProblem
from ds_config.batch import GAS, MBS, TBS, implied_world_sizes, resolve_batch_sizes
from ds_config.config import DeepSpeedConfig
from ds_config.loader import ConfigSourceError, load_config
from ds_config.schema import config_schema

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
EXIT_PIPE_CLOSED = 128 + 13  # 128 + SIGPIPE, what `yes | head` leaves for `yes`


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ds_config", description="Validate DeepSpeed configs.")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="validate a config and print a one-line verdict",
                              description="Validate a DeepSpeed config. Without --world-size the batch keys are "
                                          "checked against every data-parallel world size.")
    validate.add_argument("file", help="path to ds_config.json")
    validate.add_argument("--world-size", type=int, default=None, metavar="N",
                          help="data-parallel world size: derive and check the batch sizes for it")
    validate.add_argument("--no-strict", action="store_true", help="warn about unknown keys instead of failing")
    validate.add_argument("--print-resolved", action="store_true",
                          help="print the config with every default filled in (JSON on stdout; verdict on stderr)")
    validate.add_argument("--json", action="store_true",
                          help="print one JSON object (ok, batch, world_sizes, warnings, errors) for scripts")
    sub.add_parser("schema", help="print the JSON Schema of the config")
    return parser


def _validate(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size <= 0:
        return _fail(args, EXIT_USAGE, [f"--world-size must be a positive integer, got {args.world_size}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = load_config(args.file, world_size=args.world_size, strict=not args.no_strict)
            batch = _batch_report(config, args.world_size)
        except ConfigSourceError as exc:
            return _fail(args, EXIT_USAGE, [exc.problems[0].message])
        except ConfigError as exc:
            return _invalid(args, exc, [str(w.message) for w in caught])
    warned = [str(w.message) for w in caught]
    for message in warned:
        print(f"warning: {message}", file=sys.stderr)
    auto = config.auto_keys()
    _note_auto(auto)
    verdict = f"OK {args.file}: {batch.text}; {len(warned)} warning(s)"
    if auto:
        verdict += f"; {len(auto)} value(s) still \"auto\""
    if args.json:
        report = {"ok": True, "file": args.file, "world_size": args.world_size, "batch": batch.batch,
                  "world_sizes": batch.world_sizes, "warnings": warned, "auto": auto, "errors": [],
                  "verdict": verdict}
        if args.print_resolved:
            report["config"] = config.to_dict()
        print(json.dumps(report))
    elif args.print_resolved:  # stdout stays pure JSON (``> resolved.json``); the verdict goes to stderr
        print(json.dumps(config.to_dict(), indent=2))
        print(verdict, file=sys.stderr)
    else:
        print(verdict)
    return EXIT_OK


@dataclass(frozen=True)
class _Batch:
    """The batch part of the verdict: ``text`` for people, the resolved triple (when one world size is known or
    implied) and the world sizes that fit (a list, ``"any"``, or None when the batch keys are not numbers)."""

    text: str
    batch: dict[str, int] | None = None
    world_sizes: list[int] | str | None = None


def _batch_report(config: DeepSpeedConfig, world_size: int | None) -> _Batch:
    """Raises ``ConfigError`` when no world size is given and the batch keys fit none."""
    if world_size is not None:
        return _Batch(_triple(config.batch.as_dict(), world_size), config.batch.as_dict(), [world_size])
    if config.elasticity.enabled:
        return _Batch("batch sizes come from the elasticity section (give --world-size to resolve them)")
    given = (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps)
    if "auto" in given:
        return _Batch("batch sizes still \"auto\" (the Hugging Face integration fills them in)")
    if given[0] is None and given[1] is None:
        return _Batch("no batch size given (deepspeed.initialize needs train_batch_size or "
                      "train_micro_batch_size_per_gpu)")
    fits = implied_world_sizes(*given)
    if fits is None:  # train_batch_size follows from the world size
        per_rank = given[1] * (given[2] or 1)
        return _Batch(f"{TBS} = micro {given[1]} x GAS {given[2] or 1} x world size ({per_rank} per rank; "
                      "any world size fits)", world_sizes="any")
    first = [resolve_batch_sizes(*given, world_size=ws).as_dict() for ws in fits[:4]]
    if len(fits) == 1:
        return _Batch(f"{_triple(first[0], fits[0])} (the only world size that fits)", first[0], list(fits))
    shown = ", ".join(f"{ws} (micro {b[MBS]} x GAS {b[GAS]})" for ws, b in zip(fits, first, strict=False))
    more = f", ... ({len(fits)} world sizes in all, up to {fits[-1]})" if len(fits) > 4 else ""
    return _Batch(f"{TBS} {given[0]} fits world size {shown}{more}", None, list(fits))


def _triple(batch: dict[str, int], world_size: int) -> str:
    return f"{TBS} {batch[TBS]} = micro {batch[MBS]} x GAS {batch[GAS]} x world size {world_size}"


def _invalid(args: argparse.Namespace, exc: ConfigError, warned: list[str]) -> int:
    print(f"{args.file}: {exc}", file=sys.stderr)
    if args.world_size is not None and all("still \"auto\"" in p.message for p in exc.problems):
        print("hint: leave out --world-size to check the rest of a config whose batch sizes are "
              "filled in later", file=sys.stderr)
    if args.json:
        print(json.dumps({"ok": False, "file": args.file, "errors": [_problem(p) for p in exc.problems],
                          "warnings": warned}))
    return EXIT_INVALID


def _problem(problem: ConfigProblem) -> dict[str, str]:
    return {"path": problem.path, "message": problem.message}


def _fail(args: argparse.Namespace, code: int, messages: list[str]) -> int:
    for message in messages:
        print(f"error: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"ok": False, "file": args.file, "errors": [{"path": "", "message": m} for m in messages],
                          "warnings": []}))
    return code


def _note_auto(keys: list[str], shown: int = 8) -> None:
    """Valid, but not ready for ``deepspeed.initialize`` on its own: say which values a client must fill in."""
    if not keys:
        return
    listed = ", ".join(keys[:shown]) + (f", ... ({len(keys)} in all)" if len(keys) > shown else "")
    print(f"note: {len(keys)} value(s) still \"auto\" ({listed}): the Hugging Face Trainer/Accelerate "
          "integration fills them in; deepspeed.initialize rejects them if they are still \"auto\"",
          file=sys.stderr)


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if args.command == "schema":
        print(json.dumps(config_schema(), indent=2))
        return EXIT_OK
    return _validate(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (EXIT_PIPE_CLOSED when stdout's reader left early)."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
        return code
    except BrokenPipeError:
        # `... | head`: the reader has what it wanted. Point stdout at /dev/null so the interpreter's own flush at
        # exit does not raise again, and exit as a SIGPIPE-killed tool does.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
            pass
        return EXIT_PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``python -m ds_config validate FILE [--world-size N] [--no-strict]`` and ``... schema``.

Exit status: 0 valid, 1 invalid config, 2 usage error or unreadable file.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence

from ds_config._errors import ConfigError
from ds_config.loader import ConfigSourceError, load_config
from ds_config.schema import config_schema

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ds_config", description="Validate DeepSpeed configs.")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="validate a config and print it with every default filled in")
    validate.add_argument("file", help="path to ds_config.json")
    validate.add_argument("--world-size", type=int, default=None, metavar="N",
                          help="data-parallel world size: derive and check the batch sizes")
    validate.add_argument("--no-strict", action="store_true", help="warn about unknown keys instead of failing")
    sub.add_parser("schema", help="print the JSON Schema of the config")
    return parser


def _validate(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size <= 0:
        print(f"error: --world-size must be a positive integer, got {args.world_size}", file=sys.stderr)
        return EXIT_USAGE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = load_config(args.file, world_size=args.world_size, strict=not args.no_strict)
        except ConfigSourceError as exc:
            print(f"error: {exc.problems[0].message}", file=sys.stderr)
            return EXIT_USAGE
        except ConfigError as exc:
            print(f"{args.file}: {exc}", file=sys.stderr)
            if args.world_size is not None and all("still \"auto\"" in p.message for p in exc.problems):
                print("hint: leave out --world-size to check the rest of a config whose batch sizes are "
                      "filled in later", file=sys.stderr)
            return EXIT_INVALID
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    _note_auto(config.auto_keys())
    print(json.dumps(config.to_dict(), indent=2))
    return EXIT_OK


def _note_auto(keys: list[str], shown: int = 8) -> None:
    """Valid, but not ready for ``deepspeed.initialize`` on its own: say which values a client must fill in."""
    if not keys:
        return
    listed = ", ".join(keys[:shown]) + (f", ... ({len(keys)} in all)" if len(keys) > shown else "")
    print(f"note: {len(keys)} value(s) still \"auto\" ({listed}): the Hugging Face Trainer/Accelerate "
          "integration fills them in; deepspeed.initialize rejects them if they are still \"auto\"",
          file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if args.command == "schema":
        print(json.dumps(config_schema(), indent=2))
        return EXIT_OK
    return _validate(args)


if __name__ == "__main__":
    sys.exit(main())

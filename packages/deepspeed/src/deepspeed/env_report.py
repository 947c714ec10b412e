"""``deepspeed.env_report``: what ``ds_report`` prints, under DeepSpeed's module and function names.

The facts come from ds-ops' report (``ds_ops.report``): the torch build, toolchain, CPU SIMD levels and one row
per native op (compatible, built, why not). ``op_report`` prints the op rows, ``debug_report`` the environment,
``main`` both; ``cli_main`` parses DeepSpeed's ``ds_report`` flags.
"""

from __future__ import annotations

import argparse
import sys

from ds_ops import report as _report

__all__ = ["cli_main", "debug_report", "main", "op_report"]


def op_report(verbose: bool = True) -> list[tuple[str, str, str, str]]:
    """Print (when ``verbose``) and return the (op, compatible, built, note) rows."""
    rows = _report.op_rows()
    if verbose:
        print(f"{'op name':<18}{'compatible':<12}{'built':<10}note\n" + "-" * 60)
        for name, compatible, built, note in rows:
            print(f"{name:<18}{compatible:<12}{built:<10}{note}")
    return rows


def debug_report() -> list[tuple[str, str]]:
    """Print and return the environment's (label, value) pairs."""
    lines = _report.environment_lines()
    width = max(len(k) for k, _ in lines)
    print("DeepSpeed general environment info:")
    for key, value in lines:
        print(f"{key:<{width}} : {value}")
    return lines


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """The whole report; ``hide_operator_status`` leaves out the op rows, ``hide_errors_and_warnings`` their notes
    for ops that are compatible."""
    if not hide_operator_status:
        rows = _report.op_rows()
        print(f"{'op name':<18}{'compatible':<12}{'built':<10}note\n" + "-" * 60)
        for name, compatible, built, note in rows:
            shown = "" if hide_errors_and_warnings and compatible == _report._OK else note
            print(f"{name:<18}{compatible:<12}{built:<10}{shown}")
        print()
    debug_report()


def cli_main(argv: list[str] | None = None) -> None:
    """``ds_report`` with DeepSpeed's flags (``--hide_operator_status``, ``--hide_errors_and_warnings``)."""
    parser = argparse.ArgumentParser(prog="ds_report")
    parser.add_argument("--hide_operator_status", action="store_true", help="leave out the op compatibility rows")
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help="leave out notes of working ops")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    main(hide_operator_status=args.hide_operator_status, hide_errors_and_warnings=args.hide_errors_and_warnings)

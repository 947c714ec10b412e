"""``python -m ds_profiler PACKAGE.MODULE:FACTORY --input-shape 1,3,224,224``: profile the model a factory
returns. ``--kwargs`` gives keyword inputs as JSON (nested lists become tensors: ints -> int64, floats ->
the default dtype), ``--factory-kwargs`` the factory's own keyword arguments."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ds_profiler._model_profile import MODES, get_model_profile


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def load_factory(spec: str) -> Any:
    """``'pkg.module:attr'`` -> the attribute (``attr`` may be dotted)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"model factory {spec!r} must look like PACKAGE.MODULE:FACTORY")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the user's module's, report it as such
        raise CliError(f"could not import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise CliError(f"module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise CliError(f"{spec!r} is not callable (got {type(target).__name__})")
    return target


def parse_shape(text: str) -> tuple[int, ...]:
    """``'1,3,224,224'`` -> ``(1, 3, 224, 224)``."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise CliError(f"--input-shape {text!r}: expected comma-separated positive integers") from exc
    if not shape or min(shape) <= 0:
        raise CliError(f"--input-shape {text!r}: expected comma-separated positive integers")
    return shape


def _tensorize(value: Any) -> Any:
    if isinstance(value, list):
        return torch.tensor(value)
    return value


def parse_json_object(option: str, text: str | None, tensors: bool) -> dict[str, Any]:
    """A JSON object from the command line; lists become tensors when ``tensors``."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{option}: invalid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CliError(f"{option}: expected a JSON object, got {type(value).__name__}")
    return {key: _tensorize(item) for key, item in value.items()} if tensors else value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ds_profiler", description=__doc__.split("\n\n")[0])
    parser.add_argument("factory", help="PACKAGE.MODULE:FACTORY returning a torch.nn.Module")
    parser.add_argument("--input-shape", help="shape of one random input tensor, e.g. 1,3,224,224")
    parser.add_argument("--kwargs", help="JSON object of keyword inputs, e.g. '{\"input_ids\": [[1, 2]]}'")
    parser.add_argument("--factory-kwargs", help="JSON object of keyword arguments for the factory")
    parser.add_argument("--mode", choices=MODES, default="forward")
    parser.add_argument("--module-depth", type=int, default=-1)
    parser.add_argument("--top-modules", type=int, default=1)
    parser.add_argument("--warm-up", type=int, default=1)
    parser.add_argument("--no-detailed", action="store_true", help="omit the per-module tree")
    parser.add_argument("--output-file", help="write the profile there instead of stdout")
    parser.add_argument("--eval", action="store_true", help="call model.eval() before profiling")
    return parser


def run(argv: Sequence[str]) -> int:
    """Parse, build the model, profile; user errors become ``CliError``."""
    opts = build_parser().parse_args(argv)
    factory = load_factory(opts.factory)
    factory_kwargs = parse_json_object("--factory-kwargs", opts.factory_kwargs, tensors=False)
    model_kwargs = parse_json_object("--kwargs", opts.kwargs, tensors=True)
    shape = parse_shape(opts.input_shape) if opts.input_shape else None
    if shape is None and not model_kwargs:
        raise CliError("give --input-shape or --kwargs for the model call")
    try:
        model = factory(**factory_kwargs)
    except Exception as exc:
        raise CliError(f"calling {opts.factory}() failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise CliError(f"{opts.factory}() returned {type(model).__name__}, not a torch.nn.Module")
    if opts.eval:
        model.eval()
    try:
        flops, macs, params = get_model_profile(
            model, input_shape=shape, kwargs=model_kwargs, detailed=not opts.no_detailed,
            module_depth=opts.module_depth, top_modules=opts.top_modules, warm_up=opts.warm_up,
            output_file=opts.output_file, mode=opts.mode,
        )
    except Exception as exc:  # the model's own failure (wrong input shape, missing input), named as such
        inputs = f"input shape {shape}" if shape else f"keyword inputs {sorted(model_kwargs)}"
        raise CliError(f"profiling {opts.factory}() with {inputs} (mode={opts.mode}) failed: "
                       f"{type(exc).__name__}: {exc}") from exc
    print(f"flops: {flops.strip()}  macs: {macs}  params: {params}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except (CliError, ValueError, TypeError) as exc:
        print(f"ds_profiler: error: {exc}", file=sys.stderr)
        return 2

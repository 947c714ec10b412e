"""``@distributed_test``: turn a test function into a multi-rank test, parametrised over world sizes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from _harness._runner import DEFAULT_TIMEOUT_S, run_distributed

WORLD_SIZE_PARAM = "dist_world_size"


def distributed_test(
    world_size: int | Sequence[int] = 2,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    init_process_group: bool = True,
    backend: str = "gloo",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a test whose body runs on every rank; one test case per world size (ids ``2ranks``...).

    The test's own parameters (fixtures such as ``tmp_path``, ``parametrize`` arguments) are resolved by
    pytest in the parent and passed to every rank, so they must be picklable.
    """
    sizes = [world_size] if isinstance(world_size, int) else list(world_size)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"distributed_test: world_size={world_size!r} must be an int >= 1 or a list of them")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        if WORLD_SIZE_PARAM in signature.parameters or any(p.kind in variadic for p in signature.parameters.values()):
            raise TypeError(
                f"distributed_test: {fn.__qualname__} may take neither *args/**kwargs nor {WORLD_SIZE_PARAM!r}"
            )

        @functools.wraps(fn)
        def test(*args: Any, **kwargs: Any) -> None:  # args: the instance, for a test method
            __tracebackhide__ = True
            n = kwargs.pop(WORLD_SIZE_PARAM)
            run_distributed(
                fn, n, args=args, kwargs=kwargs, timeout=timeout, init_process_group=init_process_group,
                backend=backend,
            )

        # pytest reads the fixtures a test needs from its signature: the body's, plus the world size.
        params = [*signature.parameters.values()]
        params.append(inspect.Parameter(WORLD_SIZE_PARAM, inspect.Parameter.KEYWORD_ONLY))
        test.__signature__ = signature.replace(parameters=params, return_annotation=None)  # type: ignore[attr-defined]
        return pytest.mark.parametrize(WORLD_SIZE_PARAM, sizes, ids=[f"{n}ranks" for n in sizes])(test)

    return decorate

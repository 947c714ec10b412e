"""DeepCompile's state on the engine: whether compiled graphs run the ZeRO work (``is_deepcompile_active``), the
engine's own ``compile.state.DeepCompileState`` (schedule, graphs, profiles, runtime handle; made by
``engine.compile``), and the process-wide things one engine claims (captured backward inputs, Dynamo settings).
``destroy()`` releases this engine's state and claims without touching another engine's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class DeepCompileMethods:
    """Mixed into ``DeepSpeedEngine``; works on a bare engine too (every attribute read with a default)."""

    def is_deepcompile_enabled(self) -> bool:
        return bool(self._config.compile.deepcompile)

    def is_deepcompile_active(self) -> bool:
        return bool(getattr(self, "_deepcompile_active", False))

    def _set_deepcompile_active(self, active: bool) -> None:
        """Compiled graphs (active) or the ZeRO-3 module hooks (inactive) gather and release the parameters."""
        if not active:
            self._release_deepcompile_compiled_backward_state()
            self._release_deepcompile_dynamo_config()
        if self.is_deepcompile_active() == active:
            return
        scheduler = getattr(self, "zero3_scheduler", None)
        if scheduler is not None:
            if active:
                scheduler.release_all()
                scheduler.remove_hooks()
            else:
                scheduler.install_hooks()
        self._deepcompile_active = active

    def _release_deepcompile_compiled_backward_state(self) -> None:
        owned = getattr(self, "_deepcompile_owned_frames", None)
        if owned:
            from deepspeed.compile.backend import cleanup_compiled_backward_state

            cleanup_compiled_backward_state(owned_frames=owned)

    def _release_deepcompile_dynamo_config(self) -> None:
        restore = self.__dict__.pop("_deepcompile_dynamo_config_restore", None)
        if restore is not None:
            restore()

    def _release_deepcompile(self) -> None:
        """``destroy()``: this engine's DeepCompile claims go; the runtime forgets its parameters."""
        self._release_deepcompile_compiled_backward_state()
        self._release_deepcompile_dynamo_config()
        hooks = self.__dict__.pop("_deepcompile_backward_hooks", None)
        if hooks:
            from deepspeed.compile.util import remove_backward_hooks

            remove_backward_hooks(hooks)
        state = self.__dict__.pop("_deepcompile_state", None)
        if state is not None:
            from deepspeed.compile.state import release

            release(state)  # this engine's schedule, graphs, profiles and handle; another engine's stay
        self._deepcompile_active = False

    def get_compile_time(self) -> list:
        """DeepCompile's pass times: ``(fwd|bwd, graph index, graph id, seconds)`` per graph this engine compiled."""
        state = getattr(self, "_deepcompile_state", None)
        return [] if state is None else state.opt_pass_times

    def register_compile_pass(self, pass_name: str, pass_fn: Callable, contract: Any = None) -> None:
        from deepspeed.compile.backend import register_compile_pass

        register_compile_pass(pass_name, pass_fn, contract)

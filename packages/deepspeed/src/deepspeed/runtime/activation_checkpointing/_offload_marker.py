"""Which checkpoint inputs get offloaded: the active offload contexts (per thread) and the Hugging Face marker.

A saved-tensor hook sees every tensor autograd saves, and cannot tell a checkpointed layer's input (worth moving
to host memory: it is the one thing a non-reentrant checkpoint keeps) from anything else. So the input is *marked*
before the layer runs. For Hugging Face models that is done by wrapping ``GradientCheckpointingLayer.__call__``
(transformers >= 4.52): while an offload context is active and the layer checkpoints, its first positional
argument (``hidden_states``) is marked for the innermost context of this thread. The wrapper is installed by the
first context entered and removed when the last one exits, so a model used outside the contexts (e.g. by the
hybrid engine's generation) runs the class's own ``__call__``.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

__all__ = ["current_manager", "install_marker", "marker_installed", "pop_manager", "push_manager", "release_marker"]


class _Marking(Protocol):
    def mark(self, tensor: torch.Tensor) -> None: ...

    def _consume_mark(self, tensor: torch.Tensor) -> bool: ...


_local = threading.local()
_lock = threading.Lock()
_wrapper: Any = None  # our __call__ while installed
_original: Any = None  # the class's own __call__ entry (None: it inherited nn.Module's)
_users = 0  # active contexts sharing the wrapper
_permanent = False  # installed by patch_gradient_checkpointing_layer_marker: contexts never remove it


def _stack() -> list[_Marking]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current_manager() -> _Marking | None:
    """The innermost offload context active on this thread, if any."""
    stack = _stack()
    return stack[-1] if stack else None


def push_manager(manager: _Marking) -> None:
    if any(m is manager for m in _stack()):
        raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant: this instance is already active; "
                           "use a separate instance for a nested context")
    _stack().append(manager)


def pop_manager(manager: _Marking) -> None:
    stack = _stack()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is manager:
            del stack[i]
            return


def marker_installed() -> bool:
    return _wrapper is not None


def _gradient_checkpointing_layer() -> type | None:
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError:  # no transformers, or one older than 4.52: nothing to mark automatically
        return None
    return GradientCheckpointingLayer


def install_marker(permanent: bool = False) -> bool:
    """Wrap ``GradientCheckpointingLayer.__call__`` (once) for a context entering (``permanent``: for good);
    whether it is installed. A context that got True calls ``release_marker`` when it exits."""
    global _wrapper, _original, _users, _permanent
    with _lock:
        if _wrapper is None:
            layer_cls = _gradient_checkpointing_layer()
            if layer_cls is None:
                return False
            _original = layer_cls.__dict__.get("__call__")
            inherited = layer_cls.__call__

            def _marking_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
                manager = current_manager()
                marked = None
                if (manager is not None and self.training and torch.is_grad_enabled()
                        and getattr(self, "gradient_checkpointing", False) and args and torch.is_tensor(args[0])):
                    marked = args[0]  # hidden_states: what the checkpoint function receives and saves
                    manager.mark(marked)
                try:
                    return inherited(self, *args, **kwargs)
                finally:
                    if marked is not None:  # a mark the pack hook did not use must not outlive the call (id reuse)
                        manager._consume_mark(marked)

            layer_cls.__call__ = _marking_call
            _wrapper = _marking_call
        if permanent:
            _permanent = True
        else:
            _users += 1
        return True


def release_marker() -> None:
    """A context that installed (or shared) the marker exits: the last one puts the class's ``__call__`` back."""
    global _wrapper, _original, _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users or _permanent or _wrapper is None:
            return
        layer_cls = _gradient_checkpointing_layer()
        if layer_cls is not None and layer_cls.__dict__.get("__call__") is _wrapper:
            if _original is None:
                del layer_cls.__call__
            else:
                layer_cls.__call__ = _original
        _wrapper = _original = None

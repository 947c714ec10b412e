"""``deepspeed.runtime.peer_failure`` on its own: which errors count as a peer's failure, what ``/proc`` says of
a stopped, dead and reaped process, and that other errors leave the engine's phases unchanged."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from deepspeed.runtime.peer_failure import _process_state, is_transport_error, named_peer_failures


@pytest.mark.parametrize("text,expected", [
    ("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4000", True),
    ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete", True),
    ("Application timeout caused pair closure", True),
    ("mat1 and mat2 shapes cannot be multiplied (4x6 and 5x3)", False),
    ("CUDA out of memory", False),
])
def test_transport_errors_are_told_from_model_errors(text, expected):
    assert is_transport_error(RuntimeError(text)) is expected
    assert is_transport_error(ValueError(text)) is False
    assert is_transport_error(dist.DistBackendError("anything")) is True


def test_process_state_of_a_stopped_a_dead_and_a_reaped_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _process_state(child.pid).startswith("is alive")
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while "stopped" not in _process_state(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _process_state(child.pid).startswith("is stopped (SIGSTOP/SIGTSTP)")
        child.send_signal(signal.SIGKILL)
        while "died" not in _process_state(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _process_state(child.pid) == "has died (not yet reaped by its parent)"
    finally:
        child.kill()
        child.wait()
    assert _process_state(child.pid) == "is gone (killed or exited)"


def test_other_errors_pass_through_unchanged():
    with pytest.raises(ValueError, match="bad batch") as info:
        with named_peer_failures(3, "forward"):
            raise ValueError("bad batch")
    assert type(info.value) is ValueError
    with pytest.raises(RuntimeError, match="Connection closed by peer") as info:  # no process group: unchanged
        with named_peer_failures(3, "backward"):
            raise RuntimeError("Connection closed by peer")
    assert type(info.value) is RuntimeError

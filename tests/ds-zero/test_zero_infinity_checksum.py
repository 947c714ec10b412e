"""The swappers verify every read against the CRC32 of what was written (ds_zero.swap._checksum): a swap file
of the same size but other bytes raises a SwapCorruptionError naming the file, the rank and both checksums, and
is never handed to the step or installed as a partition."""

from __future__ import annotations

import types

import pytest
import torch

from ds_zero.swap import OptimizerSwapper, OptimizerSwapSettings, ParamSwapper, ParamSwapSettings
from ds_zero.swap._checksum import VERIFY_ENV, SwapChecksums, SwapCorruptionError


def _scribble(path: str) -> None:
    """Overwrite a file with other bytes of the same length (one flipped bit would do as well)."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        f.seek(0)
        f.write(bytes(data))


def _optimizer(tmp_path, monkeypatch, verify: bool) -> OptimizerSwapper:
    monkeypatch.setenv(VERIFY_ENV, "1" if verify else "0")
    settings = OptimizerSwapSettings(nvme_path=str(tmp_path), buffer_count=4, pipeline_read=True)
    swapper = OptimizerSwapper(settings, rank=3, largest_numel=64)
    swapper.init_masters([(0, lambda: torch.arange(64, dtype=torch.float32)), (1, lambda: torch.ones(64))])
    return swapper


def test_garbage_optimizer_swap_file_raises_before_the_step_sees_it(tmp_path, monkeypatch):
    swapper = _optimizer(tmp_path, monkeypatch, verify=True)
    path = swapper.path(1, "master")
    _scribble(path)
    seen = []
    with pytest.raises(SwapCorruptionError) as err:
        swapper.run([0, 1], lambda i, t: seen.append(i) or t)
    assert seen == [0]  # sub-group 1 never reached the step
    message = str(err.value)
    assert path in message and "rank 3: " in message and "CRC32" in message, message
    assert "swap in optimizer sub-group 1 (master)" in message and "modified" in message, message
    assert swapper.pool.free == swapper.pool.count  # every buffer went back to the pool
    swapper.write_now(1, {"master": torch.ones(64)})  # rewritten: reads are good again
    swapper.run([0, 1], lambda i, t: t)
    assert torch.equal(swapper.read_new(1)["master"], torch.ones(64))
    swapper.close()


def test_verification_can_be_turned_off(tmp_path, monkeypatch):
    swapper = _optimizer(tmp_path, monkeypatch, verify=False)
    _scribble(swapper.path(1, "master"))
    swapper.run([0, 1], lambda i, t: t)  # what the disk returned is used as is
    assert not torch.equal(swapper.read_new(1)["master"], torch.ones(64))
    swapper.close()


def test_gradient_pieces_are_checked_and_overlapping_rewrites_replace_their_checksums(tmp_path):
    swapper = OptimizerSwapper(OptimizerSwapSettings(nvme_path=str(tmp_path)), rank=0, largest_numel=32)
    swapper.prepare_grad(0, 32)
    swapper.write_grad(0, 0, torch.ones(16))
    swapper.write_grad(0, 16, torch.full((16,), 2.0))
    swapper.write_grad(0, 8, torch.full((16,), 3.0))  # overlaps both: their checksums no longer hold
    assert torch.equal(swapper.read_grad(0, 8, 16), torch.full((16,), 3.0))
    assert torch.equal(swapper.read_grad(0, 0, 32)[:8], torch.ones(8))  # never written as one piece: unchecked
    _scribble(swapper.path(0, "grad"))  # flips a bit of element 16, inside the last piece written
    with pytest.raises(SwapCorruptionError, match="swap in gradient of optimizer sub-group 0"):
        swapper.read_grad(0, 8, 16)
    swapper.close()


def _param(ds_id: int, numel: int) -> types.SimpleNamespace:
    part = torch.arange(numel, dtype=torch.bfloat16) + ds_id
    return types.SimpleNamespace(ds_id=ds_id, ds_tensor=part, ds_shape=(numel,))


def test_garbage_parameter_swap_file_is_never_installed(tmp_path):
    settings = ParamSwapSettings(nvme_path=str(tmp_path), buffer_count=2, buffer_size=64, max_in_cpu=0)
    swapper = ParamSwapper(settings, rank=1)
    params = [_param(0, 40), _param(1, 40)]
    for p in params:
        swapper.adopt(p)
    _scribble(swapper.path(params[1]))
    assert swapper.prefetch(params) == 2
    with pytest.raises(SwapCorruptionError, match="swap in parameter partition 1") as err:
        swapper.swap_in(params)
    assert swapper.path(params[1]) in str(err.value) and "rank 1: " in str(err.value)
    assert not swapper.reading and not swapper.resident
    assert all(p.ds_tensor.device.type == "meta" for p in params)
    assert swapper._pools[torch.bfloat16].free == 2
    with pytest.raises(SwapCorruptionError, match="read parameter partition 1"):
        swapper.read_copy(params[1])
    swapper.write(params[1], torch.full((40,), 5.0))  # a rewrite makes it good again
    swapper.swap_in(params)
    assert torch.equal(params[1].ds_tensor, torch.full((40,), 5.0, dtype=torch.bfloat16))
    swapper.close()


def test_checksum_is_of_the_bytes():
    sums = SwapChecksums(rank=0)
    sums.on = True
    t = torch.randn(1000)
    sums.record("f", t)
    sums.verify("f", t.clone())
    u = t.clone()
    u.view(torch.int32)[500] ^= 1  # the lowest mantissa bit: a different number all the same
    with pytest.raises(SwapCorruptionError):
        sums.verify("f", u)


def test_reads_of_a_failed_run_are_not_verified_later(tmp_path, monkeypatch):
    """A step that raises while the next sub-group's read is in flight: those buffers are reclaimed unread, and
    the next run must not check them (they may hold another sub-group's data by then)."""
    swapper = _optimizer(tmp_path, monkeypatch, verify=True)

    def failing(i, t):
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        swapper.run([0, 1], failing)
    assert not swapper._unverified  # sub-group 1's prefetch was drained, not left for the next wait to check
    swapper.run([0, 1], lambda i, t: t)  # sub-group 0 lands in the buffer that held 1's aborted prefetch
    assert torch.equal(swapper.read_new(0)["master"], torch.arange(64, dtype=torch.float32))
    swapper.close()

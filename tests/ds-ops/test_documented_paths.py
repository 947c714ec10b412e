"""The documented module paths (spec, chapter "Optimizers"; issue 4/5) serve the documented names with the
documented signatures, through the deepspeed meta-package's compatibility table."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import ds_ops

# (path, name, ds_ops object, documented parameters and defaults, in order); None: no default.
DOCUMENTED = [
    ("deepspeed.ops.adam", "DeepSpeedCPUAdam", ds_ops.DeepSpeedCPUAdam,
     [("model_params", None), ("lr", 0.001), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-08),
      ("weight_decay", 0), ("amsgrad", False), ("adamw_mode", True), ("fp32_optimizer_states", True)]),
    ("deepspeed.ops.adam", "FusedAdam", ds_ops.FusedAdam,
     [("params", None), ("lr", 0.001), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-08),
      ("adam_w_mode", True), ("weight_decay", 0.0), ("amsgrad", False), ("set_grad_none", True)]),
    ("deepspeed.ops.lamb", "FusedLamb", ds_ops.FusedLamb,
     [("params", None), ("lr", 0.001), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-08),
      ("eps_inside_sqrt", False), ("weight_decay", 0.0), ("max_grad_norm", 0.0), ("max_coeff", 10.0),
      ("min_coeff", 0.01), ("amsgrad", False)]),
    ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad", ds_ops.DeepSpeedCPUAdagrad, None),
    ("deepspeed.ops.lion", "DeepSpeedCPULion", ds_ops.DeepSpeedCPULion, None),
    ("deepspeed.ops.lion", "FusedLion", ds_ops.FusedLion, None),
    ("deepspeed.ops.adam.cpu_adam", "DeepSpeedCPUAdam", ds_ops.DeepSpeedCPUAdam, None),
    ("deepspeed.ops.adam.fused_adam", "FusedAdam", ds_ops.FusedAdam, None),
    ("deepspeed.ops.lamb.fused_lamb", "FusedLamb", ds_ops.FusedLamb, None),
    ("deepspeed.ops.aio", "aio_handle", ds_ops.aio.AsyncIOHandle, None),
    ("deepspeed.ops.op_builder", "AsyncIOBuilder", ds_ops.aio.AsyncIOBuilder, None),
]


@pytest.mark.parametrize("path, name, expected, params", DOCUMENTED, ids=[f"{p}.{n}" for p, n, _, _ in DOCUMENTED])
def test_documented_path_serves_the_name(path, name, expected, params):
    served = getattr(importlib.import_module(path), name)
    assert served is expected
    if params is None:
        return
    signature = list(inspect.signature(served).parameters.values())
    documented = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
                  for p in signature[:len(params)]]
    assert documented == params


def test_async_io_builder_load_gives_the_handle_deepspeed_users_call(tmp_path):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    aio = AsyncIOBuilder().load()
    handle = aio.aio_handle(4096, 4, False, True, 1)  # DeepSpeed passes the aio section positionally
    try:
        t = torch.arange(100, dtype=torch.float32)
        assert handle.sync_pwrite(t, str(tmp_path / "x.bin")) == 1
        out = torch.empty_like(t)
        assert handle.sync_pread(out, str(tmp_path / "x.bin")) == 1
        assert torch.equal(out, t)
    finally:
        handle.close()

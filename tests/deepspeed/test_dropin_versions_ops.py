"""Drop-in names of DeepSpeed 0.19.x: ``deepspeed.git_version_info``, the version in one place,
``deepspeed.DeepSpeedConfigError``, ``deepspeed.OnDevice`` and the op-builder names."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import deepspeed
import ds_config
from deepspeed import git_version_info
from ds_ops.op_builder import ALL_OPS, op_tables

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------- version, git info


def test_version_is_set_in_one_place():
    about = importlib.import_module("deepspeed.__about__").__version__
    assert deepspeed.__version__ == deepspeed.version == git_version_info.version == about
    assert about.startswith("0.19.")
    assert importlib.metadata.version("deepspeed") == about  # the distribution takes it from __about__ too
    assert (deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__) == tuple(
        int(p) for p in about.split(".")[:3])
    # the component distributions keep their own versions
    assert ds_config.__version__ == importlib.metadata.version("ds-config") != about


def test_git_hash_and_branch_name_this_checkout():
    def git(*args):
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else "unknown"

    # compared by prefix: HEAD may move between the import and this call when commits land meanwhile
    assert git_version_info.git_branch == git("--abbrev-ref", "HEAD")
    assert len(git_version_info.git_hash) >= 7 or git_version_info.git_hash == "unknown"
    assert deepspeed.git_hash == deepspeed.__git_hash__ == git_version_info.git_hash
    assert deepspeed.git_branch == deepspeed.__git_branch__ == git_version_info.git_branch


def test_version_and_git_info_cost_no_torch_import():
    code = ("import sys, deepspeed\nfrom deepspeed.git_version_info import version, git_hash, git_branch\n"
            "print(deepspeed.git_hash == git_hash, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_op_tables_come_from_the_op_registry():
    installed, compatible = op_tables()
    assert git_version_info.installed_ops == installed
    assert git_version_info.compatible_ops == compatible
    assert set(installed) == set(ALL_OPS) >= {"cpu_adam", "cpu_adagrad", "cpu_lion", "fused_adam", "fused_lamb",
                                             "fused_lion", "async_io"}
    assert compatible["deepspeed_not_implemented"] is False
    from deepspeed.git_version_info import compatible_ops, installed_ops  # PEP 562 names import too

    assert installed_ops is git_version_info.installed_ops and compatible_ops is git_version_info.compatible_ops


def test_installed_ops_load():
    """An installed op is one that loads now; the no-compiler case is tests/ds-ops/test_op_builder_dropin.py."""
    for name, installed in git_version_info.installed_ops.items():
        if installed:
            assert ALL_OPS[name]().load() is not None, name


def test_torch_info_has_deepspeeds_keys_and_describes_this_torch():
    info = git_version_info.torch_info
    assert set(info) == {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
    assert info["version"] == ".".join(torch.__version__.split(".")[:2])
    cuda = torch.version.cuda
    assert info["cuda_version"] == (".".join(cuda.split(".")[:2]) if cuda else "0.0")
    if not cuda:
        assert info["nccl_version"] == "0.0"
    assert info["hip_version"] == "0.0" or torch.version.hip
    assert info["bf16_support"] is bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert git_version_info.accelerator_name == deepspeed.accelerator.get_accelerator()._name


def test_unknown_attribute_of_git_version_info():
    with pytest.raises(AttributeError, match="no_such_name"):
        git_version_info.no_such_name  # noqa: B018


# ------------------------------------------------------------------------------------ DeepSpeedConfigError


def test_config_error_is_deepspeeds_exception():
    assert deepspeed.DeepSpeedConfigError is ds_config.ConfigError
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="zero_optimization"):
        ds_config.DeepSpeedConfig.load({"train_batch_size": 8, "zero_optimisation": {"stage": 2}})
    try:
        with pytest.raises(deepspeed.DeepSpeedConfigError, match="optimizer.params.betas"):
            deepspeed.initialize(model=torch.nn.Linear(2, 2),
                                 config={"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"betas": 3}}})
    finally:
        if torch.distributed.is_initialized():  # initialize() set up its one-process group before parsing
            torch.distributed.destroy_process_group()
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="custom check"):
        raise deepspeed.DeepSpeedConfigError("custom check failed")  # scripts raise it with a message too


# ------------------------------------------------------------------------------------------------ OnDevice


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.emb = torch.nn.Embedding(5, 4)
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.register_buffer("ids", torch.arange(3))


def _placement(module: torch.nn.Module) -> dict[str, tuple[str, torch.dtype]]:
    return {name: (t.device.type, t.dtype) for name, t in [*module.named_parameters(), *module.named_buffers()]}


def test_on_device_builds_meta_fp16():
    assert deepspeed.OnDevice is importlib.import_module("deepspeed.utils.init_on_device").OnDevice
    params = inspect.signature(deepspeed.OnDevice).parameters.values()
    assert [(p.name, p.default) for p in params] == [("dtype", inspect.Parameter.empty), ("device", "meta"),
                                                     ("enabled", True)]  # DeepSpeed's signature
    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        lin = torch.nn.Linear(1024, 1024)
        block = Block()
        explicit = torch.zeros(2, dtype=torch.float32)  # DeepSpeed converts explicit float dtypes too
    assert lin.weight.is_meta and lin.weight.dtype == torch.float16 and lin.bias.dtype == torch.float16
    places = _placement(block)
    assert {device for device, _ in places.values()} == {"meta"}
    assert places["norm.num_batches_tracked"][1] == places["ids"][1] == torch.int64  # integers keep their dtype
    assert {dtype for name, (_, dtype) in places.items() if name not in ("norm.num_batches_tracked", "ids")} == {
        torch.float16}
    assert explicit.is_meta and explicit.dtype == torch.float16


def test_on_device_real_device_keeps_values_and_leaves():
    with deepspeed.OnDevice(dtype=torch.bfloat16, device="cpu"):
        ones = torch.ones(3, requires_grad=True)
        full = torch.full((2,), 1.5, requires_grad=True)
        block = Block()
    assert torch.equal(ones, torch.ones(3, dtype=torch.bfloat16)) and ones.is_leaf and ones.requires_grad
    assert full.dtype == torch.bfloat16 and full.is_leaf and full.requires_grad
    assert torch.equal(block.scale, torch.full((3,), 2.0, dtype=torch.bfloat16))
    assert block.ids.tolist() == [0, 1, 2]


def test_disabled_on_device_does_nothing():
    reference = _placement(Block())
    with deepspeed.OnDevice(dtype=torch.float16, device="meta", enabled=False) as ctx:
        block = Block()
    assert ctx.enabled is False and _placement(block) == reference


def test_nested_on_device_applies_the_innermost_and_restores():
    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        with deepspeed.OnDevice(dtype=torch.bfloat16, device="cpu"):
            inner = torch.nn.Linear(2, 2)
            with deepspeed.OnDevice(dtype=torch.float64, device="cpu", enabled=False):
                under_disabled = torch.zeros(1)
        after_inner = torch.nn.Linear(2, 2)
    outside = torch.nn.Linear(2, 2)
    assert (inner.weight.device.type, inner.weight.dtype) == ("cpu", torch.bfloat16)
    assert (under_disabled.device.type, under_disabled.dtype) == ("cpu", torch.bfloat16)
    assert after_inner.weight.is_meta and after_inner.weight.dtype == torch.float16
    assert not outside.weight.is_meta and outside.weight.dtype == torch.float32


def test_on_device_restores_after_an_exception_and_dtype_none_only_places():
    with pytest.raises(RuntimeError, match="boom"), deepspeed.OnDevice(dtype=torch.float16):
        raise RuntimeError("boom")
    assert not torch.empty(1).is_meta
    with deepspeed.OnDevice(dtype=None, device="meta"):
        t = torch.empty(2, dtype=torch.float64)
    assert t.is_meta and t.dtype == torch.float64
    with pytest.raises(TypeError, match="torch.dtype"):
        deepspeed.OnDevice(dtype="fp16")


def test_on_device_applies_to_its_own_thread_only():
    seen = {}
    entered, checked = threading.Event(), threading.Event()

    def other_thread():
        entered.wait(10)
        seen["other"] = torch.empty(1).is_meta
        checked.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        entered.set()
        checked.wait(10)
        seen["own"] = torch.empty(1).is_meta
    worker.join(10)
    assert seen == {"other": False, "own": True}


# -------------------------------------------------------------------------------------------- op builders


def test_op_builder_serves_deepspeeds_builder_names():
    from deepspeed.ops.op_builder import (  # noqa: F401 - importing them is the test
        AsyncIOBuilder,
        CPUAdagradBuilder,
        CPUAdamBuilder,
        CPULionBuilder,
        FusedAdamBuilder,
        FusedLambBuilder,
        FusedLionBuilder,
    )

    assert FusedAdamBuilder().load().FusedAdam is importlib.import_module("deepspeed.ops.adam").FusedAdam
    assert AsyncIOBuilder().load().aio_handle is importlib.import_module("deepspeed.ops.aio").aio_handle


def test_ops_compatible_ops():
    import deepspeed.ops

    assert deepspeed.ops.__compatible_ops__ == git_version_info.compatible_ops

"""DeepSpeed's op-builder names (``deepspeed.ops.op_builder.FusedAdamBuilder``, ...) and the installed/compatible
tables (``op_tables``, behind ``deepspeed.git_version_info``) tell the truth about what ``load()`` does."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ds_ops
from ds_ops import OpBuildError, report
from ds_ops.op_builder import ALL_OPS, CUDAOpBuilder, OpBuilder, all_builders, op_tables
from ds_ops.op_builder.kernel_builders import NOT_BUILT_BUILDERS

# DeepSpeed's class name -> its NAME, for every DeepSpeed op this project has
DEEPSPEED_BUILDERS = {
    "CPUAdamBuilder": "cpu_adam",
    "CPUAdagradBuilder": "cpu_adagrad",
    "CPULionBuilder": "cpu_lion",
    "FusedAdamBuilder": "fused_adam",
    "FusedLambBuilder": "fused_lamb",
    "FusedLionBuilder": "fused_lion",
    "AsyncIOBuilder": "async_io",
}
FUSED = [("FusedAdamBuilder", "FusedAdam"), ("FusedLambBuilder", "FusedLamb"), ("FusedLionBuilder", "FusedLion")]


@pytest.mark.parametrize("cls_name", sorted(DEEPSPEED_BUILDERS))
def test_builder_has_deepspeeds_surface(cls_name):
    cls = getattr(importlib.import_module("deepspeed.ops.op_builder"), cls_name)
    builder = cls()
    assert cls.NAME == builder.name == DEEPSPEED_BUILDERS[cls_name]
    assert ALL_OPS[cls.NAME] is cls
    assert inspect.signature(builder.is_compatible).parameters["verbose"].default is False
    assert "verbose" in inspect.signature(builder.load).parameters
    assert isinstance(builder.absolute_name(), str) and builder.absolute_name()
    assert cls.BUILD_VAR == f"DS_BUILD_{cls.NAME.upper()}" or cls_name == "AsyncIOBuilder"  # DS_BUILD_AIO


@pytest.mark.parametrize("cls_name", sorted(set(DEEPSPEED_BUILDERS) - {"AsyncIOBuilder"}))
def test_sources_are_real_files(cls_name):
    sources = getattr(ds_ops.op_builder, cls_name)().sources()
    assert sources and all(os.path.isfile(s) for s in sources)


@pytest.mark.parametrize("cls_name, optimizer", FUSED)
def test_fused_builder_loads_the_optimizer_module(cls_name, optimizer):
    op = getattr(ds_ops.op_builder, cls_name)().load()
    assert getattr(op, optimizer) is getattr(ds_ops, optimizer)
    param = torch.nn.Parameter(torch.ones(4))
    opt = getattr(op, optimizer)([param], lr=0.1)
    param.grad = torch.full((4,), 0.5)
    opt.step()
    assert not torch.equal(param.detach(), torch.ones(4))  # it really trains


def test_fused_builder_without_torchs_kernel_is_incompatible(monkeypatch, capsys):
    monkeypatch.delattr(torch, "_fused_adamw_")
    builder = ds_ops.op_builder.FusedAdamBuilder()
    assert not builder.is_compatible()
    assert builder.is_compatible(verbose=True) is False and "torch._fused_adamw_" in capsys.readouterr().out
    with pytest.raises(OpBuildError, match="fused_adam.*torch._fused_adamw_"):
        builder.load()
    assert op_tables()[1]["fused_adam"] is False


def test_tables_agree_with_ds_report_and_cover_every_op():
    installed, compatible = op_tables()
    builders, errors = all_builders()
    assert not errors and set(installed) == set(builders) >= set(DEEPSPEED_BUILDERS.values())
    assert set(compatible) == set(builders) | {"deepspeed_not_implemented"}
    assert compatible["deepspeed_not_implemented"] is False
    rows = {row[0]: row for row in report.op_rows()}
    for name in builders:
        assert compatible[name] == (rows[name][1] == "[OKAY]"), rows[name]
    assert rows["fused_adam"][3] == "nothing to compile"


def test_compatible_ops_load(native):
    _, compatible = op_tables()
    for name, cls in ALL_OPS.items():
        if compatible[name]:
            assert cls().load() is not None, name


_NO_COMPILER = textwrap.dedent(
    """
    import json
    from ds_ops import OpBuildError
    from ds_ops.op_builder import OpBuilder, all_builders, op_tables
    installed, compatible = op_tables()
    loads, native = {}, {}
    for name, cls in all_builders()[0].items():
        native[name] = issubclass(cls, OpBuilder)
        try:
            cls().load()
            loads[name] = True
        except OpBuildError:
            loads[name] = False
    print(json.dumps([installed, compatible, loads, native]))
    """
)


def test_installed_means_loads_without_compiling(tmp_path):
    """With no compiler and an empty JIT cache, exactly the installed ops load; native ones are incompatible."""
    env = {**os.environ, "DS_OPS_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(tmp_path / "no-such-c++")}
    env.pop("DS_OPS_ALLOW_TORCH_FALLBACK", None)
    out = subprocess.run([sys.executable, "-c", _NO_COMPILER], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    installed, compatible, loads, native = json.loads(out.stdout.strip().splitlines()[-1])
    assert installed == loads
    not_built = {cls.NAME for cls in NOT_BUILT_BUILDERS}  # DeepSpeed's ops of features this version lacks
    # CUDA ops are never prebuilt; the one registered (evoformer_attn) ships no kernel sources, so never compatible
    not_built |= {name for name, cls in ALL_OPS.items() if issubclass(cls, CUDAOpBuilder)}
    for name, is_native in native.items():
        if is_native:
            assert compatible[name] == installed[name]  # only a prebuilt library can load here
        elif name in not_built:
            assert not installed[name] and not compatible[name]
        else:
            assert installed[name] and compatible[name]
    assert not_built and not_built <= set(native)
    assert any(native.values()) and not all(native.values())
    assert issubclass(ALL_OPS["cpu_adam"], OpBuilder)


def test_deepspeeds_other_op_names_answer_compatibility():
    """Every op name DeepSpeed exports resolves: torch-implemented ones load their module, the ops of features
    this version lacks say so (incompatible, and load() names the feature) so callers can skip them."""
    from ds_ops.op_builder import InferenceBuilder, SparseAttnBuilder, StochasticTransformerBuilder, TransformerBuilder

    _, compatible = op_tables()
    assert TransformerBuilder().load().DeepSpeedTransformerLayer is ds_ops.transformer.DeepSpeedTransformerLayer
    assert StochasticTransformerBuilder.NAME == "stochastic_transformer" and compatible["transformer"]
    assert not compatible["sparse_attn"] and not compatible[InferenceBuilder.NAME]  # Triton kernels: not built
    with pytest.raises(OpBuildError, match="Triton block-sparse kernels"):
        SparseAttnBuilder().load()
    with pytest.raises(OpBuildError, match="'transformer_inference' is part of the CUDA inference kernels"):
        InferenceBuilder().load()
    assert not InferenceBuilder().is_compatible() and not InferenceBuilder().is_built()

"""DeepSpeed4Science Evoformer attention: the torch implementation against a plain softmax reference (values and
gradients, sliced and unsliced), and EvoformerAttnBuilder's build checks (CUTLASS discovery and version, targets)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn import functional as F

import ds_ops.deepspeed4science.evoformer_attn as evo
from ds_ops import OpBuildError
from ds_ops.deepspeed4science import DS4Sci_EvoformerAttention
from ds_ops.op_builder import EvoformerAttnBuilder, op_tables
from ds_ops.op_builder.builder import CUDAOpBuilder
from ds_ops.op_builder.cuda_archs import default_compute_capabilities, parse_arch_list


def reference(q, k, v, biases):
    q, k, v = (t.transpose(-2, -3).float() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    for b in biases:
        scores = scores + b.float()
    return (F.softmax(scores, -1) @ v).transpose(-2, -3)


def inputs(dtype, shape=(2, 3, 9, 2, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, n, length, h, _ = shape
    q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.randint(0, 2, (b, n, 1, 1, length), generator=gen)
    mask[..., 0] = 1  # no row fully masked
    mask_bias = (1e9 * (mask.float() - 1)).to(dtype)
    pair = torch.randn((b, 1, h, length, length), generator=gen).to(dtype).requires_grad_()
    return q, k, v, mask_bias, pair


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_matches_reference_with_gradients(dtype, tol):
    q, k, v, mask_bias, pair = inputs(dtype)
    grad = torch.randn(q.shape).to(dtype)
    ref = reference(q, k, v, [mask_bias, pair])
    ref.backward(grad.float())
    ref_grads = [t.grad.clone() for t in (q, k, v, pair)]
    for t in (q, k, v, pair):
        t.grad = None
    out = DS4Sci_EvoformerAttention(q, k, v, [mask_bias, pair])
    assert out.dtype == dtype and out.shape == q.shape
    out.backward(grad)
    assert (out.float() - ref).abs().max() < tol
    for got, want in zip((q.grad, k.grad, v.grad, pair.grad), ref_grads, strict=True):
        assert (got.float() - want.float()).abs().max() < 4 * tol


def test_gradcheck_fp64_and_row_slicing_is_exact(monkeypatch):
    q, k, v, _, pair = inputs(torch.float64, shape=(1, 3, 5, 2, 3))
    row_bias = torch.randn(1, 3, 1, 1, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: DS4Sci_EvoformerAttention(*a[:3], list(a[3:])),
                                    (q, k, v, row_bias, pair))
    whole = DS4Sci_EvoformerAttention(q, k, v, [row_bias, pair])
    monkeypatch.setattr(evo, "SCORE_BUDGET_BYTES", 1)  # one row per slice
    assert evo._rows_per_slice(q.transpose(-2, -3)) == 1
    torch.testing.assert_close(DS4Sci_EvoformerAttention(q, k, v, [row_bias, pair]), whole, rtol=0, atol=1e-12)


def test_optional_biases_and_no_bias_grad_when_not_asked():
    q, k, v, mask_bias, pair = inputs(torch.float32)
    torch.testing.assert_close(DS4Sci_EvoformerAttention(q, k, v, []), reference(q, k, v, []))
    torch.testing.assert_close(DS4Sci_EvoformerAttention(q, k, v, [mask_bias]), reference(q, k, v, [mask_bias]))
    torch.testing.assert_close(DS4Sci_EvoformerAttention(q, k, v, [None, pair]), reference(q, k, v, [pair]))
    DS4Sci_EvoformerAttention(q, k, v, [mask_bias, pair.detach()]).sum().backward()
    assert q.grad is not None and mask_bias.grad is None


def test_bad_shapes_are_named():
    q, k, v, mask_bias, pair = inputs(torch.float32)
    with pytest.raises(ValueError, match=r"biases\[1\] has shape .* must be \(2, 1, 2, 9, 9\)"):
        DS4Sci_EvoformerAttention(q, k, v, [mask_bias, pair[:, :, :, :3]])
    with pytest.raises(ValueError, match="at most 2 biases"):
        DS4Sci_EvoformerAttention(q, k, v, [mask_bias, pair, pair])
    with pytest.raises(ValueError, match=r"one \[B, N, L, H, D\] shape"):
        DS4Sci_EvoformerAttention(q[0], k[0], v[0], [])


def cutlass_tree(root, version=(3, 5, 1)):
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "include" / "cutlass" / "cutlass.h").write_text("// header\n")
    (root / "include" / "cutlass" / "version.h").write_text(
        "".join(f"#define CUTLASS_{n} {x}\n" for n, x in zip(("MAJOR", "MINOR", "PATCH"), version, strict=True)))
    (root / "tools" / "util" / "include").mkdir(parents=True)
    return root


def test_cutlass_found_from_env_prefix_and_version_checked(tmp_path, monkeypatch):
    for var in ("CUTLASS_PATH", "CPATH", "CONDA_PREFIX", "VIRTUAL_ENV", "CMAKE_PREFIX_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(EvoformerAttnBuilder, "_python_package_cutlass_paths", staticmethod(lambda: []))
    new = cutlass_tree(tmp_path / "new")
    monkeypatch.setenv("CMAKE_PREFIX_PATH", f"{tmp_path / 'nothing'}:{new}")
    builder = EvoformerAttnBuilder()
    assert builder.include_paths() == [str(new / "include"), str(new / "tools" / "util" / "include")]
    assert builder.cutlass_version() == (3, 5, 1) and not builder._cutlass_problems()

    old = cutlass_tree(tmp_path / "old", version=(2, 11, 0))
    monkeypatch.setenv("CUTLASS_PATH", str(old / "include"))  # the include folder itself is accepted too
    builder = EvoformerAttnBuilder()
    assert builder.include_paths()[0] == str(old / "include")
    assert any("CUTLASS 2.11.0" in p and ">= 3.1.0" in p for p in builder.compatibility_problems())

    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path / "nothing"))
    with pytest.raises(RuntimeError, match="does not contain the CUTLASS headers"):
        EvoformerAttnBuilder().include_paths()
    monkeypatch.setenv("CUTLASS_PATH", EvoformerAttnBuilder.CUTLASS_IGNORE)
    assert EvoformerAttnBuilder().include_paths() == []
    monkeypatch.setenv("CUTLASS_PATH", EvoformerAttnBuilder.CUTLASS_PYTHON_BINDINGS)
    with pytest.raises(ImportError, match="pip install nvidia-cutlass"):
        EvoformerAttnBuilder().include_paths()


def test_op_is_incompatible_here_and_load_says_why(monkeypatch):
    monkeypatch.setenv("CUTLASS_PATH", EvoformerAttnBuilder.CUTLASS_IGNORE)
    builder = EvoformerAttnBuilder()
    assert builder.BUILD_VAR == "DS_BUILD_EVOFORMER_ATTN" and builder.name == "evoformer_attn"
    assert not builder.is_compatible()
    installed, compatible = op_tables()
    assert installed["evoformer_attn"] is False and compatible["evoformer_attn"] is False
    with pytest.raises(OpBuildError, match="does not ship DeepSpeed's CUTLASS Evoformer kernel"):
        builder.load()


def test_targets_filtered_deduplicated_and_exported(monkeypatch, capsys):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "6.1 7.0;8.0;8.0+PTX")
    builder = EvoformerAttnBuilder()
    flags = builder.compute_capability_args()
    assert flags == ["-gencode=arch=compute_70,code=sm_70", "-gencode=arch=compute_80,code=sm_80",
                     "-gencode=arch=compute_80,code=compute_80"]
    assert "excluding targets below SM 7.0" in capsys.readouterr().err and not builder.enable_bf16
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "7.0;8.0+PTX"  # torch's builder must not re-add 6.1
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "6.0")
    with pytest.raises(OpBuildError, match="no compute capability is left"):
        builder.compute_capability_args()
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert CUDAOpBuilder("probe").compute_capability_args("8.6;9.0")[-1] == "-gencode=arch=compute_90,code=sm_90"


def test_arch_lists_parse_and_defaults_follow_the_toolkit():
    assert parse_arch_list(" 7.5;8.6 9.0+PTX ") == ["7.5", "8.6", "9.0+PTX"]
    with pytest.raises(ValueError, match=r"TORCH_CUDA_ARCH_LIST='Ampere'.*MAJOR.MINOR"):
        parse_arch_list("Ampere")
    assert default_compute_capabilities(None) == ["6.0", "6.1", "7.0"]
    assert default_compute_capabilities((11, 8))[-3:] == ["8.0", "8.6", "9.0"]
    assert default_compute_capabilities((12, 8))[-2:] == ["10.0", "12.0"]
    assert "7.0" not in default_compute_capabilities((13, 0))  # CUDA 13 dropped pre-Turing targets


def test_deprecated_arch_env_warns(monkeypatch):
    builder = EvoformerAttnBuilder()
    builder.build_for_cpu = True  # the base nvcc_args then needs no toolkit
    monkeypatch.setenv("DS_EVOFORMER_GPU_ARCH", "80")
    assert builder.nvcc_args() == []
    assert "DS_EVOFORMER_GPU_ARCH is deprecated" in builder.error_log

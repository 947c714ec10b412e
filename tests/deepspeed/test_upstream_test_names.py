"""Names DeepSpeed's own unit tests import (issue 26, docs/upstream-tests.md), checked on their behaviour:
ZeRO++'s ``CUDAQuantizer``, ``autotuning.utils.set_val_by_key``, ``utils.nvtx.instrument_w_nvtx``, the merged
Hugging Face tensor-parallel plan, and the upstream runner's guard against a rank's pytest outcome killing its
pool worker (the hang of ``TestCPUAdagradGPUError``)."""

from __future__ import annotations

import importlib.util
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

import deepspeed.utils.nvtx as ds_nvtx
from deepspeed.autotuning.utils import get_val_by_key, set_val_by_key
from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan
from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- CUDAQuantizer

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_quantizer_round_trip_within_half_a_step(dtype):
    torch.manual_seed(0)
    param = (torch.randn(4096) * 3).to(dtype)
    quantizer = CUDAQuantizer()
    codes, scales = quantizer.quantize(param)
    groups = quantizer.groups_for(param.numel())
    assert codes.dtype == torch.int8 and codes.numel() == param.numel()
    assert scales.numel() == groups and param.numel() % (8 * groups) == 0
    back = quantizer.dequantize(codes, scales, dtype=dtype)
    assert back.dtype == dtype
    # per group: within half a quantization step (max|group| / 254) of the fp16 value the op read, plus the
    # rounding to the requested dtype
    ref = param.half().float().view(groups, -1)
    err = (back.float().view(groups, -1) - ref).abs().amax(dim=1)
    step = ref.abs().amax(dim=1) / 127
    rounding = ref.abs().amax(dim=1) * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
    assert torch.all(err <= step / 2 + rounding + 1e-6)
    assert quantizer.dequantize(codes, scales).dtype == torch.float16  # the op's own output dtype


def test_cuda_quantizer_groups_respect_the_target_and_the_vector_width():
    quantizer = CUDAQuantizer()
    for numel in (8, 4096, 8000 * 3, 1 << 20, 12 * 1024 + 8):
        groups = quantizer.groups_for(numel)
        assert numel % (8 * groups) == 0
        assert numel / groups < 16000
        assert numel in CUDAQuantizer.group_size_cache
    with pytest.raises(ValueError, match="multiple of 8"):
        quantizer.groups_for(4097)


def test_cuda_quantizer_uses_a_replaced_op_module(monkeypatch):
    calls = []

    class Op:
        Symmetric = 0

        def quantize(self, param, groups, num_bits, quant_type):
            calls.append(("q", param.dtype, groups, num_bits, quant_type))
            return param.to(torch.int8), torch.ones(groups)

        def dequantize(self, q, scale, num_groups, num_bits, quant_type):
            calls.append(("d", num_groups))
            return q.to(torch.half)

    monkeypatch.setattr(CUDAQuantizer, "quantizer_cuda_module", Op())
    q, s = CUDAQuantizer().quantize(torch.ones(64, dtype=torch.bfloat16), groups=2)
    out = CUDAQuantizer().dequantize(q, s, dtype=torch.bfloat16)
    assert calls == [("q", torch.float16, 2, 8, 0), ("d", 2)]
    assert out.dtype == torch.bfloat16


def test_quantizer_op_refuses_what_it_does_not_build():
    op = CUDAQuantizer.quantizer_cuda_module or CUDAQuantizer().quantizer_cuda_module
    x = torch.randn(64, dtype=torch.half)
    with pytest.raises(ValueError, match="num_bits=4"):
        op.quantize(x, 2, 4, op.Symmetric)
    with pytest.raises(ValueError, match="quant_type=1"):
        op.quantize(x, 2, 8, op.Asymmetric)
    with pytest.raises(ValueError, match="groups=3"):
        op.quantize(x, 3, 8, op.Symmetric)


# ------------------------------------------------------------------------------------------- autotuning

def test_set_val_by_key_sets_every_occurrence_and_adds_none():
    exp = {"a": 1, "zero": {"offload": {"device": "cpu"}, "b": {"device": "none"}}, "device": "x"}
    set_val_by_key(exp, "device", "nvme")
    assert exp == {"a": 1, "zero": {"offload": {"device": "nvme"}, "b": {"device": "nvme"}}, "device": "nvme"}
    set_val_by_key(exp, "missing", 3)
    assert get_val_by_key(exp, "missing") is None


# ------------------------------------------------------------------------------------------- nvtx

class _Recorder:
    def __init__(self, domains: bool):
        self.supports_nvtx_domain = domains
        self.calls: list[tuple] = []

    def range_push(self, msg, **kw):
        self.calls.append(("push", msg, *kw.values()))

    def range_pop(self, **kw):
        self.calls.append(("pop", *kw.values()))


def _traced(x):
    if x < 0:
        raise ValueError("negative")
    return x * 2


@pytest.mark.parametrize("domains", [True, False])
def test_instrument_w_nvtx_pushes_and_pops_around_each_call(monkeypatch, domains):
    rec = _Recorder(domains)
    monkeypatch.setattr(ds_nvtx, "get_accelerator", lambda: rec)
    fn = ds_nvtx.instrument_w_nvtx(_traced)
    assert fn.__name__ == "_traced"
    assert fn(3) == 6
    with pytest.raises(ValueError):
        fn(-1)  # the range is closed also when the function raises
    dom = ("DeepSpeed",) if domains else ()
    assert rec.calls == [("push", "_traced", *dom), ("pop", *dom)] * 2
    monkeypatch.setattr(ds_nvtx, "enable_nvtx", False)
    assert fn(1) == 2
    assert len(rec.calls) == 4


def test_instrument_w_nvtx_names_a_profiler_range_on_cpu():
    fn = ds_nvtx.instrument_w_nvtx(_traced)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(2)
    assert "_traced" in {e.name for e in prof.events()}


# ------------------------------------------------------------------------------------------- HF tp_plan

def test_hf_tp_plan_merges_config_class_and_instance():
    class Config:
        base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}

    class Model:
        _tp_plan = {"lm_head": "colwise_rep"}

        def __init__(self):
            self.config = Config()
            self._tp_plan = {"model.layers.*.self_attn.q_proj": "colwise", "extra": "rowwise"}

    assert _get_hf_tp_plan(Model()) == {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
                                        "lm_head": "colwise_rep", "extra": "rowwise"}

    class Bare:
        config = None
        _tp_plan = {}

    assert _get_hf_tp_plan(Bare()) is None


# ------------------------------------------------------------------------------------------- upstream runner

def _load_runner_plugin():
    spec = importlib.util.spec_from_file_location("upstream_tests", ROOT / "scripts" / "upstream_tests.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["upstream_tests"] = module  # the pool pickles the wrapper by this module name
    spec.loader.exec_module(module)
    return module


def _fail_like_pytest(rank):
    if rank == 1:
        pytest.fail("DID NOT RAISE <class 'AssertionError'>")  # a BaseException, as in DeepSpeed's test
    return rank


def test_runner_turns_a_rank_outcome_into_a_prompt_error(monkeypatch):
    plugin = _load_runner_plugin()
    monkeypatch.setattr(multiprocessing.pool, "starmapstar", multiprocessing.pool.starmapstar)
    plugin.pytest_configure(None)
    assert multiprocessing.pool.starmapstar is plugin._starmapstar
    with multiprocessing.get_context("fork").Pool(2) as pool:
        result = pool.starmap_async(_fail_like_pytest, [(0,), (1,)])
        with pytest.raises(plugin.RankOutcome, match="rank 1 ended with Failed: DID NOT RAISE"):
            result.get(timeout=60)  # without the guard: no result until the timeout, the worker is gone
        assert pool.starmap(_fail_like_pytest, [(0,), (2,)]) == [0, 2]

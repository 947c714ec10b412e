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


# ------------------------------------------------------------------------------------------- pinned memory

def test_pin_memory_tracker_totals_and_logs_each_doubling(monkeypatch):
    import deepspeed.utils.pin_memory_tracker as pmt

    infos = []
    monkeypatch.setattr(pmt.logger, "info", infos.append)
    tracker = pmt._PinnedMemoryTracker()
    monkeypatch.setattr(pmt, "_tracker", tracker)
    gb = 1 << 30
    pmt.track_pinned_memory(31 * gb)
    assert infos == [] and tracker._next_checkpoint == 32 * gb
    pmt.track_pinned_memory(2 * gb)  # 33 GB: crosses 32
    pmt.track_pinned_memory(100 * gb)  # 133 GB: crosses 64 and 128 in one call, logged once
    assert tracker._bytes == 133 * gb and tracker._calls == 3 and tracker._next_checkpoint == 256 * gb
    assert len(infos) == 2 and "crossed 32.000 GB" in infos[0] and "crossed 128.000 GB" in infos[1]
    pmt.pinned_memory_summary("offload")
    assert infos[-1] == "[pinned-memory offload] 133.000 GB pinned across 3 allocations"
    assert [pmt._fmt_bytes(n) for n in (512, 2048, 1 << 20)] == ["512 B", "2.0 KB", "1.00 MB"]


def test_accelerator_pin_memory_counts_pinned_copies_only(monkeypatch):
    import deepspeed.accelerator.abstract_accelerator as abstract
    from deepspeed.accelerator import get_accelerator

    seen = []
    monkeypatch.setattr(abstract, "track_pinned_memory", seen.append)
    t = torch.zeros(256)
    out = get_accelerator().pin_memory(t)
    # no CUDA here: nothing can be pinned, the tensor comes back unchanged and nothing is counted
    assert (out is t and seen == []) or (out.is_pinned() and seen == [t.nbytes])


# ------------------------------------------------------------------------------------------- parallel_state_sp

def _sp_groups():
    import torch.distributed as dist

    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_mpu

    try:
        sp_mpu.get_sequence_parallel_group()
    except RuntimeError as exc:
        before = str(exc)
    sp_mpu.initialize_sequence_parallel(2)
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=sp_mpu.get_sequence_parallel_group())
    return (before, sp_mpu.get_sequence_parallel_world_size(), sp_mpu.get_sequence_parallel_rank(),
            sp_mpu.get_sequence_data_parallel_world_size(), sp_mpu.get_sequence_data_parallel_rank(),
            sp_mpu.get_model_parallel_rank(), t.item())


def test_parallel_state_sp_builds_consecutive_sequence_groups():
    from _harness import run_distributed

    out = run_distributed(_sp_groups, world_size=4, timeout=60)
    assert all("initialize_sequence_parallel" in o[0] for o in out)
    assert [o[1:] for o in out] == [(2, 0, 4, 0, 0, 1.0), (2, 1, 4, 1, 1, 1.0), (2, 0, 4, 2, 0, 5.0),
                                    (2, 1, 4, 3, 1, 5.0)]


# ------------------------------------------------------------------------------------------- ResourceManager

def test_resource_manager_takes_deepspeeds_positional_signature(tmp_path):
    from deepspeed.autotuning.scheduler import ResourceManager

    rm = ResourceManager(None, "worker-0, worker-1", 4, str(tmp_path), str(tmp_path), {" mbs ": " --mbs "})
    assert rm.active_resources == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert rm.arg_mappings == {"mbs": "--mbs"} and rm.num_gpus_per_node == 4
    ours = ResourceManager(None, {"h": [1, 3]}, None, str(tmp_path), str(tmp_path), None)
    assert ours.nodes == ["h"] and ours.num_gpus_per_node == 2
    with pytest.raises(ValueError, match="num_gpus_per_node=None"):
        ResourceManager(None, ["h"], None, str(tmp_path), str(tmp_path), None)


# ------------------------------------------------------------------------------------------- engine.autotp_size

def _engine_autotp_size():
    from _autotp_models import tiny

    import deepspeed

    model = tiny("llama").train()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    plain, *_ = deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1,
                                                                           "optimizer": {"type": "SGD",
                                                                                         "params": {"lr": 0.1}}})
    return engine.autotp_size(), plain.autotp_size()


def test_engine_autotp_size_reads_the_config():
    from _harness import run_distributed

    out = run_distributed(_engine_autotp_size, world_size=2, timeout=120)
    assert out[0][0] == out[1][0] == 2
    assert out[0][1] in (0, 1)

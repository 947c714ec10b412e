"""DeepSpeed module paths its own unit tests and clients import (issue 26): checkpoint names and engine, ZeRO's
package names (linear, handles, unwrap_model_for_generation), behaving as DeepSpeed's."""

from __future__ import annotations

import os

import pytest
import torch
from _harness import run_distributed


def test_checkpoint_file_names_are_deepspeeds(tmp_path) -> None:
    from deepspeed.checkpoint import (
        UNIVERSAL_CHECKPOINT_INFO,
        get_layer_ckpt_name_for_rank,
        get_model_ckpt_name_for_rank,
        get_zero_ckpt_name_for_rank,
    )
    from deepspeed.checkpoint.ds_to_universal import UNIVERSAL_CHECKPOINT_INFO as WRITER_KEY

    assert get_model_ckpt_name_for_rank("d", "00") == os.path.join("d", "mp_rank_00_model_states.pt")
    assert get_zero_ckpt_name_for_rank("d", 3, 1) == os.path.join("d", "zero_pp_rank_3_mp_rank_01_optim_states.pt")
    assert get_layer_ckpt_name_for_rank("d", "layer_01", 2) == os.path.join("d", "layer_01-model_02_model_states.pt")
    assert UNIVERSAL_CHECKPOINT_INFO == WRITER_KEY  # one key for the writer and for clients


def test_torch_checkpoint_engine_round_trip(tmp_path) -> None:
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo, TorchCheckpointEngine

    engine = TorchCheckpointEngine()
    info = CheckpointCommitInfo("step1", str(tmp_path), True)
    engine.create(info)
    engine.makedirs(tmp_path / "step1", exist_ok=True)
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7}
    engine.save(state, str(tmp_path / "step1" / "a.pt"))
    assert engine.commit(info) is True and not engine.is_decoupled()
    loaded = engine.load(str(tmp_path / "step1" / "a.pt"))
    assert loaded["step"] == 7 and torch.equal(loaded["w"], state["w"])
    assert not [n for n in os.listdir(tmp_path / "step1") if n != "a.pt"]  # no temporary left behind


def test_multiple_all_gather_handles_forward_the_keyword() -> None:
    from deepspeed.runtime.zero.partition_parameters import MultipleAllGatherHandles

    seen = []

    class Handle:
        def wait(self, handle_dependency):
            seen.append(handle_dependency)

    MultipleAllGatherHandles([Handle(), Handle()]).wait(handle_dependency=False)
    assert seen == [False, False]


def test_zero3_linear_matches_f_linear() -> None:
    from deepspeed.runtime.zero.linear import LinearModuleForZeroStage3

    torch.manual_seed(0)
    ours = LinearModuleForZeroStage3(5, 3)
    ref = torch.nn.Linear(5, 3)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 4, 5)
    for m in (ours, ref):
        m(x).square().sum().backward()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def _unwrap_body() -> tuple[bool, bool, bool, float]:
    import deepspeed
    from deepspeed.runtime.zero import unwrap_model_for_generation

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
              "stage3_param_persistence_threshold": 0}, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    x = torch.randn(2, 8)
    with unwrap_model_for_generation(engine) as unwrapped:
        gathered = all(p.numel() > 0 for p in unwrapped.parameters())
        no_hooks = not engine.zero3_scheduler._handles
        out = unwrapped(x)  # twice: the weights stay gathered without the hooks
        still = all(p.numel() > 0 for p in unwrapped.parameters()) and torch.equal(out, unwrapped(x))
    released = all(p.numel() == 0 for p in engine.module.parameters())
    loss = engine(x).square().mean()  # training resumes with the hooks back
    engine.backward(loss)
    engine.step()
    return gathered and still, no_hooks, released, float(loss)


def test_unwrap_model_for_generation_gathers_once_and_restores_the_hooks() -> None:
    for gathered, no_hooks, released, loss in run_distributed(_unwrap_body, world_size=2, timeout=120):
        assert gathered and no_hooks and released
        assert loss > 0


def test_accelerator_typed_tensor_constructors() -> None:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    flags = acc.ByteTensor([1, 0, 1])
    assert flags.dtype == torch.uint8 and flags.tolist() == [1, 0, 1] and flags.device.type == acc.device_name()
    assert acc.FloatTensor(2, 3).shape == (2, 3) and acc.LongTensor(4).dtype == torch.int64
    assert isinstance(flags, acc.ByteTensor) and not isinstance(flags, acc.FloatTensor)
    assert acc.BFloat16Tensor([1.5]).dtype == torch.bfloat16 and acc.HalfTensor([1.0]).dtype == torch.float16
    assert not hasattr(acc, "NoSuchTensor")


def test_elasticity_submodules_are_attributes_after_import_deepspeed() -> None:
    import subprocess
    import sys

    code = "import deepspeed; print(deepspeed.elasticity.config.ElasticityConfig.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "ElasticityConfig"


def _partitioned_body(numel: int) -> tuple[list[int], bool, bool]:
    import torch.distributed as dist

    from deepspeed.runtime.utils import PartitionedTensor

    full = torch.arange(numel, dtype=torch.float32).reshape(-1, 1) * 1.5
    part = PartitionedTensor(full, dist.group.WORLD)
    meta = part.to_meta()
    again = PartitionedTensor.from_meta(meta, part.data(), dist.group.WORLD)
    return meta.tolist(), torch.equal(again.full(), full), torch.equal(part.full(), full)


def test_partitioned_tensor_round_trips_through_its_metadata() -> None:
    for numel in (8, 7):  # even split (all-gather) and uneven (per-owner broadcast)
        results = run_distributed(_partitioned_body, world_size=2, args=(numel,), timeout=60)
        for rank, (meta, rebuilt, gathered) in enumerate(results):
            assert meta == [2, numel, 1, 2, rank, 0, (numel + 1) // 2, numel]  # DeepSpeed's layout
            assert rebuilt and gathered


def test_tp_shard_widths() -> None:
    from deepspeed.module_inject import tp_shard

    try:
        tp_shard.set_num_kv_heads(6)
        assert tp_shard.get_shard_size_list(384, 4, "layers.0.self_attn.q_proj") == [128, 128, 64, 64]
        tp_shard.set_tp_grain_size(64)
        sizes = tp_shard.get_shard_size_list(1000, 3, "mlp.down_proj")
        assert sizes == [320, 320, 360]  # 15 whole grains of 64 over 3 ranks, the 40-element tail on the last
        with pytest.raises(ValueError, match="num=0"):
            tp_shard.set_tp_grain_size(0)
    finally:
        tp_shard.set_num_kv_heads(None)
        tp_shard.set_tp_grain_size(1)


def _coalesced_body() -> tuple[list[list[float]], list[list[float]]]:
    import torch.distributed as dist

    from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce, reduce_scatter_coalesced

    rank = dist.get_rank()
    inputs = [rank * torch.arange(0.0, 6.0), rank * torch.arange(6.0, 9.0), torch.zeros(1)]
    scattered = reduce_scatter_coalesced(inputs, dist.group.WORLD)
    grid = (rank + 1) * torch.arange(16.0).reshape(4, 4)  # 16 = 2 x 2 x world: the quantized path
    quant = all_to_all_quant_reduce([grid, torch.ones(3)], {})
    return [t.tolist() for t in scattered], [t.tolist() for t in quant]


def test_coalesced_reduce_scatter_and_quantized_reduce() -> None:
    results = run_distributed(_coalesced_body, world_size=2, timeout=90)
    assert results[0][0] == [[0.0, 0.5, 1.0], [3.0, 3.5], [0.0]]  # averages of rank 0's slices (ceil(n/2) each)
    assert results[1][0] == [[1.5, 2.0, 2.5], [4.0], []]
    for rank, (_, quant) in enumerate(results):
        expected = (1.5 * torch.arange(16.0)).reshape(2, 8)[rank]  # mean of 1x and 2x the grid, this rank's half
        torch.testing.assert_close(torch.tensor(quant[0]), expected, atol=0.1, rtol=0.02)  # int8 codes
        assert quant[1] == ([1.0, 1.0] if rank == 0 else [1.0])  # 1-D: the unquantized fallback


def test_env_report_prints_ops_and_environment(capsys) -> None:
    import deepspeed.env_report as env_report

    env_report.cli_main([])
    out = capsys.readouterr().out
    assert "cpu_adam" in out and "torch version" in out
    env_report.cli_main(["--hide_operator_status"])
    assert "cpu_adam" not in capsys.readouterr().out


def test_op_builder_builder_module() -> None:
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from deepspeed.ops.op_builder.builder import MissingCUDAException, OpBuilder, installed_cuda_version

    assert issubclass(CPUAdamBuilder, OpBuilder)  # one class identity whichever path imports it
    if getattr(torch.version, "hip", None) is None:
        assert OpBuilder.installed_rocm_version() == (0, 0) and not OpBuilder.is_rocm_pytorch()
    if torch.version.cuda is None and not os.environ.get("CUDA_HOME"):
        with pytest.raises(MissingCUDAException, match="nvcc"):
            installed_cuda_version("probe")

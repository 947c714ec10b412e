"""Compression of an mpu's Megatron-style model-parallel linears: ``init_compression(model, cfg, mpu=mpu)`` turns
``mpu.ColumnParallelLinear`` / ``mpu.RowParallelLinear`` into ``ColumnParallelLinear_Compress`` /
``RowParallelLinear_Compress`` holding the same weight shards; on 2 gloo ranks the sharded MLP gives the unsharded
one's outputs and input gradients, and weight quantization acts on each rank's shard."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

from deepspeed.compression.basic_layer import ColumnParallelLinear_Compress, RowParallelLinear_Compress
from deepspeed.compression.compress import init_compression


class _Mpu:
    """The mpu interface the layers use, with Megatron's two linear classes as attributes."""

    class ColumnParallelLinear(nn.Module):
        def __init__(self, full: nn.Linear, gather_output: bool) -> None:
            super().__init__()
            rank, world = dist.get_rank(), dist.get_world_size()
            self.input_size, self.output_size = full.in_features, full.out_features
            self.gather_output, self.skip_bias_add = gather_output, False
            self.weight = nn.Parameter(full.weight.detach().chunk(world, 0)[rank].clone())
            self.bias = nn.Parameter(full.bias.detach().chunk(world, 0)[rank].clone())

    class RowParallelLinear(nn.Module):
        def __init__(self, full: nn.Linear, input_is_parallel: bool, skip_bias_add: bool = False) -> None:
            super().__init__()
            rank, world = dist.get_rank(), dist.get_world_size()
            self.input_size, self.output_size = full.in_features, full.out_features
            self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
            self.weight = nn.Parameter(full.weight.detach().chunk(world, 1)[rank].clone())
            self.bias = nn.Parameter(full.bias.detach().clone())

    @staticmethod
    def get_model_parallel_world_size() -> int:
        return dist.get_world_size()

    @staticmethod
    def get_model_parallel_rank() -> int:
        return dist.get_rank()

    @staticmethod
    def get_model_parallel_group():
        return dist.group.WORLD


class _MLP(nn.Module):
    def __init__(self, up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x):
        hidden, _ = self.up(x)
        out, bias = self.down(torch.relu(hidden))
        return out if bias is None else out + bias


def _quantization(offset: int) -> dict:
    return {"compression_training": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": offset, "quantize_groups": 1,
                              "quantization_type": "symmetric", "quantize_weight_in_forward": True},
        "different_groups": {"wq": {"params": {"start_bits": 2, "target_bits": 2, "quantization_period": 1},
                                    "modules": ["up", "down"]}}}}}


def _sharded_equals_full(gather_output: bool, skip_bias_add: bool):
    torch.manual_seed(0)
    up_full, down_full = nn.Linear(6, 8), nn.Linear(8, 5)
    x = torch.randn(3, 6)
    x_ref = x.clone().requires_grad_()
    reference = down_full(torch.relu(up_full(x_ref)))
    reference.square().sum().backward()
    up = _Mpu.ColumnParallelLinear(up_full, gather_output)
    down = _Mpu.RowParallelLinear(down_full, input_is_parallel=not gather_output, skip_bias_add=skip_bias_add)
    shards = (up.weight, down.weight)
    model = _MLP(up, down)
    init_compression(model, _quantization(offset=100), mpu=_Mpu)
    kinds = (type(model.up).__name__, type(model.down).__name__)
    same_params = model.up.weight is shards[0] and model.down.weight is shards[1]
    x_in = x.clone().requires_grad_()
    out = model(x_in)
    out.square().sum().backward()
    equal = torch.allclose(out, reference, atol=1e-6) and torch.allclose(x_in.grad, x_ref.grad, atol=1e-6)
    # weight quantization switched on (2 bits): each rank's shard holds at most 4 distinct values
    model.up.enable_weight_quantization(2, 2, 1, True, "symmetric", 1, "nearest")
    model.up.weight_quantization_enabled = True
    distinct = int(torch.unique(model.up.compressed_weight().detach()).numel())
    return kinds, same_params, equal, distinct <= 4


@pytest.mark.parametrize("gather_output,skip_bias_add", [(False, False), (True, True)])
def test_model_parallel_linears_compress_and_match_the_full_mlp(gather_output, skip_bias_add):
    results = run_distributed(_sharded_equals_full, world_size=2, args=(gather_output, skip_bias_add), timeout=60)
    assert results == [(("ColumnParallelLinear_Compress", "RowParallelLinear_Compress"), True, True, True)] * 2


class _OneRank:
    @staticmethod
    def get_model_parallel_world_size() -> int:
        return 3


def test_sizes_must_divide_over_the_model_parallel_group():
    with pytest.raises(ValueError, match="output_size=8 is not divisible by the model-parallel world size 3"):
        ColumnParallelLinear_Compress(_OneRank, 4, 8)
    with pytest.raises(ValueError, match="input_size=10 is not divisible"):
        RowParallelLinear_Compress(_OneRank, 10, 6)

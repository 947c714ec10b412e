"""DeepSpeed's ``TPPlanConverter`` (Hugging Face tp_plan -> AutoTP layer specs), the ``gather_output`` column
layers and the ``grad_allreduce`` replicated parameters those plans produce."""

import re

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

from ds_inference.autotp import AutoTPConfig, PartitionType, autotp_shard, hf_tp_plan_specs
from ds_inference.autotp.tp_plan_converter import TPPlanConverter


def test_convert_styles_and_patterns():
    specs = TPPlanConverter.convert({"layers.*.q_proj": "colwise", "layers.*.o_proj.weight": "rowwise",
                                     "lm_head": "colwise_rep", "head2": "colwise_gather_output",
                                     "layers.*.q_norm": "replicated_with_grad_allreduce"})
    kinds = [(s.partition_type, s.gather_output, s.grad_allreduce) for s in specs]
    assert kinds == [(PartitionType.COLUMN, False, False), (PartitionType.ROW, False, False),
                     (PartitionType.COLUMN, True, False), (PartitionType.COLUMN, True, False),
                     (PartitionType.SKIP, False, True)]
    assert specs[0].patterns == [r".*layers\..*\.q_proj\.weight$"]
    assert specs[1].patterns == [r".*layers\..*\.o_proj\.weight$"]  # no second .weight
    assert re.match(specs[0].patterns[0], "model.layers.10.self_attn.q_proj.weight")
    assert not re.match(specs[0].patterns[0], "model.layers.0.self_attn.q_proj.bias")
    assert TPPlanConverter.convert({}) is None


def test_unsupported_style_rejects_the_plan():
    with pytest.raises(ValueError, match=r"unsupported partition style\(s\): \['local_colwise'\]"):
        TPPlanConverter.convert({"a": "local_colwise", "b": "rowwise"})
    with pytest.raises(ValueError, match="moe_tp_experts"):
        hf_tp_plan_specs({"a": "colwise", "experts": "moe_tp_experts"})


def test_config_dict_reads_gather_output_and_grad_allreduce():
    config = AutoTPConfig.from_dict({"layer_specs": [
        {"patterns": [r".*lm_head\.weight$"], "partition_type": "column", "gather_output": True},
        {"patterns": [r".*q_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True}]})
    assert config.layer_specs[0].gather_output and not config.layer_specs[0].grad_allreduce
    assert config.layer_specs[1].grad_allreduce


class _Block(nn.Module):
    """up (column) -> a LayerNorm over each group of 4 features (replicated: each rank normalises its own
    group) -> down (row) -> head (column, output gathered)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(4)
        self.down = nn.Linear(8, 6)
        self.head = nn.Linear(6, 10)

    def forward(self, x):
        h = self.norm(self.up(x).unflatten(-1, (-1, 4))).flatten(-2)
        return self.head(self.down(h.relu()))


def _sharded_equals_full(plan):
    torch.manual_seed(0)
    full = _Block()
    x = torch.randn(3, 6)
    reference = full(x)
    reference.square().sum().backward()
    model = _Block()
    model.load_state_dict(full.state_dict())
    autotp_shard(model, dist.group.WORLD, layer_specs=TPPlanConverter.convert(plan), tp_grain_size=1,
                 keep_module_on_host=True)
    out = model(x)
    out.square().sum().backward()
    return (tuple(model.head.weight.shape), torch.allclose(out, reference, atol=1e-5),
            torch.allclose(model.norm.weight.grad, full.norm.weight.grad, atol=1e-5))


PLAN = {"up": "colwise", "down": "rowwise", "head": "colwise_gather_output"}


def test_gather_output_and_grad_allreduce_on_two_ranks():
    plan = {**PLAN, "norm": "replicated_with_grad_allreduce"}
    with_hook = run_distributed(_sharded_equals_full, world_size=2, args=(plan,), timeout=60)
    # the head keeps 5 of its 10 output rows, the gathered output equals the unsharded model's, and the norm's
    # gradient is the whole model's once the partial gradients are summed
    assert with_hook == [((5, 6), True, True)] * 2
    without = run_distributed(_sharded_equals_full, world_size=2, args=(PLAN,), timeout=60)
    assert without == [((5, 6), True, False)] * 2  # each rank alone sees only its group's share


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.up = nn.Linear(6, 8)
        self.lm_head = nn.Linear(6, 10, bias=False)
        self.lm_head.weight = self.embed.weight


def _tied_head_stays_whole():
    import warnings

    model = _TiedLM()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autotp_shard(model, dist.group.WORLD, keep_module_on_host=True, tp_grain_size=1,
                     layer_specs=TPPlanConverter.convert({"up": "colwise", "lm_head": "colwise_gather_output"}))
    return (type(model.lm_head) is nn.Linear, model.lm_head.weight is model.embed.weight,
            tuple(model.up.weight.shape), any("tied to 'embed.weight'" in str(w.message) for w in caught))


def test_gathered_head_tied_to_the_embedding_stays_replicated():
    assert run_distributed(_tied_head_stays_whole, world_size=2, timeout=60) == [(True, True, (4, 6), True)] * 2

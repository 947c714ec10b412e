"""``PipelineModule`` / ``LayerSpec`` / ``TiedLayerSpec`` in one process: DeepSpeed's partition arithmetic
(hand-computed), the one-stage module against ``nn.Sequential``, activation checkpointing, the checkpoint paths,
the served ``deepspeed.pipe`` names and bad input."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed
from torch import nn

from ds_pipe import LayerSpec, PipelineModule, TiedLayerSpec
from ds_pipe.module import partition_balanced, partition_uniform


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Embed(Block):
    pass


class Head(Block):
    pass


# ---------------------------------------------------------------- partition arithmetic (worked by hand)

@pytest.mark.parametrize(("items", "parts", "expected"), [
    (10, 4, [0, 3, 6, 8, 10]),   # chunk 2, residual 2: the first two parts get one more
    (8, 2, [0, 4, 8]),
    (7, 3, [0, 3, 5, 7]),
    (3, 4, [0, 1, 2, 3, 3]),     # fewer items than parts: one each, then empty
    (5, 1, [0, 5]),
])
def test_partition_uniform(items, parts, expected):
    assert partition_uniform(items, parts) == expected


@pytest.mark.parametrize(("weights", "parts", "expected"), [
    ([3, 4, 5], 2, [0, 2, 3]),              # 7|5 (spread 2) beats 3|9 (spread 6)
    ([1, 1, 1, 1], 2, [0, 2, 4]),
    ([1, 2, 1], 2, [0, 2, 3]),              # 1|3 and 3|1 tie at spread 2: DeepSpeed's `>=` takes the later split
    ([20, 20, 80, 68], 2, [0, 3, 4]),       # 120|68 (52) beats 40|148 (108) and 20|168 (148)
    ([0, 1, 1, 1, 1, 0, 0], 2, [0, 3, 7]),  # 'type:' weights: two matches per stage
    ([5, 5], 3, [0, 1, 2, 2]),              # fewer items than parts: uniform
])
def test_partition_balanced(weights, parts, expected):
    assert partition_balanced(weights, parts) == expected


# ---------------------------------------------------------------- one stage in one process

def _specs(n: int = 6, dim: int = 4) -> list:
    return [LayerSpec(Block, dim) if i % 2 == 0 else LayerSpec(nn.Linear, dim, dim) for i in range(n)]


def _reference(specs: list, base_seed: int = 1234) -> nn.Sequential:
    layers = []
    for idx, spec in enumerate(specs):
        torch.manual_seed(base_seed + idx)
        layers.append(spec.build())
    return nn.Sequential(*layers)


def test_one_stage_matches_sequential():
    specs = _specs()
    pipe = PipelineModule(specs, num_stages=1, seed_layers=True, loss_fn=nn.MSELoss())
    ref = _reference(specs)
    x = torch.randn(5, 4)
    torch.testing.assert_close(pipe(x), ref(x), rtol=0, atol=0)
    assert pipe.state_dict().keys() == ref.state_dict().keys()  # '0.lin.weight', '1.weight', ...
    assert (pipe.num_stages, pipe.stage_id, pipe.parts, pipe.mpu()) == (1, 0, [0, 6], None)
    assert pipe.topology().get_axis_names() == ["pipe", "data"] and pipe.topology().dims == [1, 1]
    assert isinstance(pipe.loss_fn, nn.MSELoss) and pipe.get_additional_losses() is None
    assert pipe.tied_comms == {} and pipe.get_tied_weights_and_groups() == []


def test_nn_sequential_plain_modules_and_callables():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pipe = PipelineModule(list(seq) + [lambda t: t * 2], num_stages=1)
    x = torch.randn(3, 4)
    torch.testing.assert_close(pipe(x), seq(x) * 2)
    assert PipelineModule(seq, num_stages=1).parts == [0, 3]


def test_one_stage_tied_layers_share_one_module():
    specs = [TiedLayerSpec("emb", nn.Linear, 4, 4, bias=False), LayerSpec(nn.Tanh),
             TiedLayerSpec("emb", nn.Linear, 4, 4, bias=False, forward_fn=lambda m, x: x @ m.weight,
                           tied_weight_attr="weight")]
    pipe = PipelineModule(specs, num_stages=1, partition_method="uniform")
    weight = pipe.tied_modules["emb"].weight
    x = torch.randn(2, 4)
    torch.testing.assert_close(pipe(x), torch.tanh(x @ weight.t()) @ weight)
    assert pipe.tied_weight_attrs == {"emb": ["weight"]} and len(list(pipe.parameters())) == 1


def test_layer_spec_builds_lazily_and_repr():
    spec = LayerSpec(nn.Linear, 4, 2, bias=False)
    assert repr(spec) == "Linear(4, 2, bias=False)"
    built = spec.build(log=True)
    assert isinstance(built, nn.Linear) and built.bias is None and spec.build() is not built


def test_parameters_partition_counts_trainable_only():
    frozen = nn.Linear(100, 100)
    frozen.requires_grad_(False)
    pipe = PipelineModule([frozen, LayerSpec(nn.Linear, 2, 2)], num_stages=1)
    assert pipe._count_layer_params() == [0, 6]


# ---------------------------------------------------------------- activation checkpointing

def _grads(module: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("interval", [1, 2, 4])
def test_activation_checkpointing_same_outputs_and_grads(interval):
    specs = _specs() + [LayerSpec(nn.ReLU)]
    calls = []

    def counting(fn, *args):
        calls.append(len(args))
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    plain = PipelineModule(specs, num_stages=1, seed_layers=True)
    ckpt = PipelineModule(specs, num_stages=1, seed_layers=True, activation_checkpoint_interval=interval,
                          activation_checkpoint_func=counting)
    x = torch.randn(3, 4)  # an input without requires_grad: the first chunk's weights still get gradients
    out_plain, out_ckpt = plain(x), ckpt(x)
    torch.testing.assert_close(out_ckpt, out_plain, rtol=0, atol=0)
    out_plain.square().sum().backward()
    out_ckpt.square().sum().backward()
    for name, grad in _grads(plain).items():
        torch.testing.assert_close(_grads(ckpt)[name], grad, rtol=0, atol=0)
    # 7 layers, the last a parameter-free ReLU: with interval 1 that chunk runs without checkpointing
    assert len(calls) == {1: 6, 2: 3, 4: 2}[interval]


def test_checkpointable_layers_select_by_class_name():
    pipe = PipelineModule(_specs(4), num_stages=1, checkpointable_layers=["Block"],
                          activation_checkpoint_interval=1)
    pipe._precompute_checkpointable_values()
    assert pipe.is_checkpointable_results == [True, False, True, False]
    assert pipe._is_checkpointable([nn.ReLU()]) is False
    default = PipelineModule(_specs(2), num_stages=1)
    assert default._is_checkpointable([nn.ReLU(), nn.Linear(1, 1)]) is True
    assert default._is_checkpointable([nn.ReLU(), torch.tanh]) is False


def test_set_checkpoint_interval_rebuilds_the_chunk_results_at_once():
    layers = [nn.ReLU(), nn.ReLU(), nn.Linear(2, 2), nn.Linear(2, 2)]
    pipe = PipelineModule(layers, num_stages=1, activation_checkpoint_interval=2)
    pipe._precompute_checkpointable_values()
    assert pipe.is_checkpointable_results == [False, True]
    pipe.set_checkpoint_interval(1)  # forward() zips chunks with these results: they must follow the interval
    assert pipe.activation_checkpoint_interval == 1
    assert pipe.is_checkpointable_results == [False, False, True, True]


def test_tuple_activations_pass_between_checkpointed_chunks():
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x), x

    class Join(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, pair):
            return self.lin(pair[0]) + pair[1]

    specs = [LayerSpec(Split), LayerSpec(Join)]
    a = PipelineModule(specs, num_stages=1, seed_layers=True)
    b = PipelineModule(specs, num_stages=1, seed_layers=True, activation_checkpoint_interval=1)
    x = torch.randn(2, 4)
    torch.testing.assert_close(b(x), a(x))


# ---------------------------------------------------------------- checkpoint paths

def test_checkpoint_paths(tmp_path):
    pipe = PipelineModule(_specs(3), num_stages=1)
    assert pipe.ckpt_prefix("/ck", "global_step7") == "/ck/global_step7/module-pipe_00"
    assert pipe.ckpt_layer_path("/ck", 2) == "/ck/layer_02-model_states.pt"
    for name in ["layer_01-model_states.pt", "layer_01-model_00-model_states.pt", "layer_11-model_states.pt"]:
        (tmp_path / name).write_bytes(b"")
    assert pipe.ckpt_layer_path_list(str(tmp_path), 1) == [str(tmp_path / "layer_01-model_00-model_states.pt"),
                                                         str(tmp_path / "layer_01-model_states.pt")]


# ---------------------------------------------------------------- served paths

def test_served_by_deepspeed_pipe_and_initialize_builds_the_pipeline_engine():
    import deepspeed
    import deepspeed.pipe
    import deepspeed.runtime.pipe.module
    import ds_pipe.module

    assert deepspeed.runtime.pipe.module is ds_pipe.module
    assert deepspeed.pipe.PipelineModule is PipelineModule and deepspeed.pipe.LayerSpec is LayerSpec
    assert deepspeed.pipe.TiedLayerSpec is TiedLayerSpec
    assert deepspeed.pipe.ProcessTopology.__name__ == "ProcessTopology"
    first, second, kind = run_distributed(_train_one_stage, world_size=1, timeout=60)[0]
    assert kind == "PipelineEngine" and second < first


def _train_one_stage():
    import deepspeed

    pipe = PipelineModule(_specs(2), num_stages=1, loss_fn=lambda out, labels: out.square().mean())
    engine, *_ = deepspeed.initialize(model=pipe, config={"train_batch_size": 2, "optimizer": {"type": "SGD",
                                                                                              "params": {"lr": 0.1}}})
    assert engine.is_first_stage() and engine.is_last_stage()
    data = iter([(torch.ones(2, 4), None)] * 2)
    return float(engine.train_batch(data)), float(engine.train_batch(data)), type(engine).__name__


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("typename", [lambda: None, nn.Linear(2, 2), int, "Linear"])
def test_layer_spec_of_a_non_module_type(typename):
    with pytest.raises(TypeError, match="torch.nn.Module subclass"):
        LayerSpec(typename)


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({}, ValueError, "num_stages or topology"),
    ({"num_stages": 2}, ValueError, "num_stages=2 must divide 1 process"),
    ({"num_stages": 0}, ValueError, "num_stages must be a positive int"),
    ({"topology": "pipe"}, TypeError, "topology must be a ProcessTopology"),
    ({"num_stages": 1, "partition_method": "profile"}, ValueError, "partition_method='profile'"),
    ({"num_stages": 1, "partition_method": "type:conv"}, ValueError, "'type:conv' matches no layer"),
    ({"num_stages": 1, "partition_method": [0, 2]}, ValueError, "explicit boundaries"),
    ({"num_stages": 1, "partition_method": 3}, TypeError, "partition_method must be"),
    ({"num_stages": 1, "activation_checkpoint_interval": -1}, ValueError, "activation_checkpoint_interval"),
    ({"num_stages": 1, "checkpointable_layers": "Block"}, TypeError, "checkpointable_layers must be a list"),
])
def test_bad_arguments_name_themselves(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        PipelineModule(_specs(3), **kwargs)


def test_topology_bigger_than_the_world_and_more_stages_than_layers():
    from ds_pipe import PipeDataParallelTopology, ProcessTopology

    with pytest.raises(ValueError, match="topology .* has 2 ranks but runs on 1 process"):
        PipelineModule(_specs(3), topology=PipeDataParallelTopology(num_pp=2, num_dp=1))
    with pytest.raises(ValueError, match="no 'pipe' axis"):
        PipelineModule(_specs(3), topology=ProcessTopology(["data"], [1]))
    with pytest.raises(ValueError, match="disagrees"):
        PipelineModule(_specs(3), num_stages=2, topology=PipeDataParallelTopology(num_pp=1, num_dp=1))
    with pytest.raises(ValueError, match=r"more stages \(num_stages=1\) than layers \(0\)"):
        PipelineModule([], num_stages=1)
    with pytest.raises(TypeError, match="layer 1 is a int"):
        PipelineModule([nn.ReLU(), 3], num_stages=1)
    with pytest.raises(TypeError, match="nesting"):
        PipelineModule([PipelineModule([nn.ReLU()], num_stages=1)], num_stages=1)

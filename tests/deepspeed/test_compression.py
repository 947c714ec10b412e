"""deepspeed.compression on plain nn.Modules: quantizers, the bit schedule, activation quantization, sparse/row/
channel pruning, redundancy_clean's shrinking (cleaned model == masked model), layer reduction and config errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from deepspeed.compression import (
    Conv2dLayer_Compress,
    LinearLayer_Compress,
    compression_scheduler,
    init_compression,
    redundancy_clean,
)
from deepspeed.compression.scheduler import quantized_share, scheduled_bits
from deepspeed.compression.utils import quantize, topk_mask
from ds_config import ConfigError


def _distinct_per_group(t: torch.Tensor, groups: int) -> list[int]:
    return [int(torch.unique(g).numel()) for g in t.detach().reshape(groups, -1)]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def section(**techniques) -> dict:
    return {"compression_training": techniques}


def wq(start=8, target=4, period=2, offset=0, forward=True, groups=1, qtype="symmetric", modules=("0",), **extra):
    shared = {"enabled": True, "schedule_offset": offset, "quantize_groups": groups, "quantization_type": qtype,
              "quantize_weight_in_forward": forward, **extra}
    return {"shared_parameters": shared, "different_groups": {"wq1": {
        "params": {"start_bits": start, "target_bits": target, "quantization_period": period},
        "modules": list(modules)}}}


def pruning(method="l1", ratio=0.5, offset=0, modules=("0",), related=None, **shared):
    group = {"params": {"dense_ratio": ratio}, "modules": list(modules)}
    if related is not None:
        group["related_modules"] = related
    return {"shared_parameters": {"enabled": True, "schedule_offset": offset, "method": method, **shared},
            "different_groups": {"g1": group}}


# ---------------------------------------------------------------------------------------------- quantizers
@pytest.mark.parametrize("qtype", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantized_tensor_has_at_most_2_pow_bits_values_per_group(qtype, bits, rounding):
    x = torch.randn(16, 64) * torch.linspace(0.1, 5, 16)[:, None]  # groups with very different ranges
    q = quantize(x, bits, qtype, num_groups=4, rounding=rounding)
    assert q.shape == x.shape and q.dtype == x.dtype
    assert max(_distinct_per_group(q, 4)) <= 2 ** bits
    # every value stays near the original: one grid step (symmetric); the asymmetric grid's zero point is
    # rounded onto the grid, which can clip the top by up to one more step
    flat = x.reshape(4, -1)
    if qtype == "symmetric":
        bound = 2 * flat.abs().amax(1) / 2 ** bits
    else:
        bound = 2 * (flat.amax(1) - flat.amin(1)) / 2 ** bits
    assert ((q - x).reshape(4, -1).abs() <= bound[:, None] * 1.01 + 1e-6).all()


def test_ternary_and_binary_and_their_symmetric_only_rule():
    x = torch.randn(4, 32)
    x[0, :5] = 0  # exact zeros must not add a third binary value
    assert max(_distinct_per_group(quantize(x, 2, num_groups=4), 4)) <= 3
    assert max(_distinct_per_group(quantize(x, 1, num_groups=4), 4)) == 2
    with pytest.raises(ValueError, match="symmetric only"):
        quantize(x, 2, "asymmetric")
    with pytest.raises(ValueError, match="quantize_groups=3 must divide"):
        quantize(x, 8, num_groups=3)


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.full((20000,), 0.3)
    x[0] = 1.0  # fixes the range: grid step 2/16
    q = quantize(x, 4, rounding="stochastic")
    assert abs(q[1:].mean().item() - 0.3) < 0.01  # nearest rounding would give 0.25
    assert abs(quantize(x, 4)[1:].mean().item() - 0.25) < 1e-6


def test_schedule_formulas():
    assert [scheduled_bits(s, 8, 4, 3) for s in (0, 2, 3, 5, 6, 11, 12, 100)] == [8, 8, 7, 7, 6, 5, 4, 4]
    assert quantized_share(0, 8, 4, 3, 0.25) == 0.25 and quantized_share(2, 8, 4, 3, 0.25) == 0.75
    assert quantized_share(3, 8, 4, 3, 0.25) == 0.25  # bits dropped: the blend starts over
    assert quantized_share(40, 8, 4, 3, 0.25) == 1.0


# ---------------------------------------------------------------------------------------------- weight quantization
def test_weight_bits_follow_the_schedule_in_forward_mode():
    model = mlp()
    cfg = section(weight_quantization=wq(start=8, target=5, period=2, offset=3, groups=4))
    init_compression(model, cfg)
    layer = model[0]
    assert isinstance(layer, LinearLayer_Compress) and not isinstance(model[2], LinearLayer_Compress)  # only "0"
    original = layer.weight.detach().clone()
    sched = compression_scheduler(model, cfg)
    x = torch.randn(3, 8)
    seen = []
    for step in range(12):
        if step < 3:  # warm-up: the plain layer
            assert not layer.weight_quantization_enabled
            torch.testing.assert_close(layer(x), nn.functional.linear(x, original, layer.bias))
        else:
            seen.append(layer.weight_quantize_bits)
            assert max(_distinct_per_group(layer.compressed_weight(), 4)) <= 2 ** layer.weight_quantize_bits
        sched.step()
    assert seen == [8, 8, 7, 7, 6, 6, 5, 5, 5]
    torch.testing.assert_close(layer.weight.detach(), original)  # forward mode never touches the stored weight


def test_optimizer_step_mode_stores_quantized_weights_and_mixes_in():
    model = mlp()
    mixed = {"enabled": True, "quantize_change_ratio": 0.25}
    cfg = section(weight_quantization=wq(start=4, target=4, period=10, forward=False, groups=2,
                                         qtype="asymmetric", fp16_mixed_quantize=mixed))
    init_compression(model, cfg)
    sched = compression_scheduler(model, cfg)
    w0 = model[0].weight.detach().clone()
    sched.step()  # 1 step past the offset: quantized share 0.25 * 2 -> blend of the weight and its 4-bit value
    torch.testing.assert_close(model[0].weight.detach(), 0.5 * w0 + 0.5 * quantize(w0, 4, "asymmetric", 2))
    assert max(_distinct_per_group(model[0].weight, 2)) > 16
    sched.step(), sched.step()  # share 1.0 -> fully quantized
    assert max(_distinct_per_group(model[0].weight, 2)) <= 16


def test_gradients_pass_straight_through_quantization():
    model = mlp()
    cfg = section(weight_quantization=wq(start=3, target=3), activation_quantization={
        "shared_parameters": {"enabled": True, "range_calibration": "dynamic"},
        "different_groups": {"aq": {"params": {"bits": 4}, "modules": ["0"]}}})
    init_compression(model, cfg)
    compression_scheduler(model, cfg)
    model(torch.randn(4, 8)).sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- activation quantization
@pytest.mark.parametrize("qtype", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("calibration", ["dynamic", "static"])
def test_activation_quantization(qtype, calibration):
    model = mlp()
    cfg = section(activation_quantization={
        "shared_parameters": {"enabled": True, "quantization_type": qtype, "range_calibration": calibration,
                              "schedule_offset": 1},
        "different_groups": {"aq": {"params": {"bits": 4}, "modules": ["2"]}}})
    init_compression(model, cfg)
    sched = compression_scheduler(model, cfg)
    seen = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append(m.quantize_input(args[0]).detach()))
    x = torch.randn(5, 8)
    model(x)
    assert not model[2].activation_quantization_enabled  # schedule_offset 1
    assert seen[-1].unique().numel() > 16
    sched.step()
    model(x)
    groups = 5 if calibration == "dynamic" else 1  # per token, or one tracked range
    assert max(_distinct_per_group(seen[-1], groups)) <= 16
    if calibration == "static":
        lo, hi = model[2].activation_quantizer.x_min_max
        assert lo < 0 < hi  # GELU output range tracked


# ---------------------------------------------------------------------------------------------- pruning
@pytest.mark.parametrize("method", ["l1", "topk"])
@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_sparse_pruning_obeys_dense_ratio(method, ratio):
    model = mlp()
    cfg = section(sparse_pruning=pruning(method, ratio, modules=["0", "2"]))
    init_compression(model, cfg)
    compression_scheduler(model, cfg)
    for layer in (model[0], model[2]):
        kept = int((layer.compressed_weight() != 0).sum())
        assert kept == math.ceil(ratio * layer.weight.numel())
        if method == "l1":  # the largest magnitudes survive
            threshold = layer.weight.abs().flatten().sort(descending=True).values[kept - 1]
            assert (layer.weight.abs()[layer.compressed_weight() != 0] >= threshold).all()
    x = torch.randn(4, 8)
    masked = model(x)
    redundancy_clean(model, cfg)
    assert int((model[0].weight != 0).sum()) == math.ceil(ratio * 128)
    assert not hasattr(model[0], "sparse_pruning_mask")
    torch.testing.assert_close(model(x), masked)


def test_sparse_pruning_excluded_modules_stay_dense():
    model = mlp()
    cfg = section(sparse_pruning=pruning("l1", 0.25, modules=["*"], excluded_modules=["^2$"]))
    init_compression(model, cfg)
    compression_scheduler(model, cfg)
    assert int((model[0].compressed_weight() != 0).sum()) == 32  # "*" reaches layer 0
    assert type(model[2]) is nn.Linear and int((model[2].weight != 0).sum()) == 128  # excluded: untouched
    with pytest.raises(ValueError, match="matches no Linear/Conv2d module"):  # excluding all of a group's scope
        init_compression(mlp(), section(sparse_pruning=pruning(modules=["2"], excluded_modules=["2"])))


def test_topk_scores_learn_and_pruning_waits_for_its_offset():
    model = mlp()
    cfg = section(sparse_pruning=pruning("topk", 0.5, offset=2))
    init_compression(model, cfg)
    sched = compression_scheduler(model, cfg)
    x = torch.randn(4, 8)
    assert int((model[0].compressed_weight() != 0).sum()) == 128  # before the offset: dense
    sched.step(), sched.step()
    model(x).sum().backward()
    assert model[0].sparse_mask_scores.grad.abs().sum() > 0  # straight-through to the scores
    assert int((model[0].compressed_weight() != 0).sum()) == 64


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_row_pruning_with_related_module_shrinks_both_layers(method):
    model = mlp()
    cfg = section(row_pruning=pruning(method, 0.25, modules=["^0$"], related=[["^2$"]]))
    init_compression(model, cfg)
    compression_scheduler(model, cfg)
    x = torch.randn(6, 8)
    masked = model(x)
    kept_rows = model[0].get_mask("row").reshape(-1).bool()
    assert int(kept_rows.sum()) == 4
    before = model[0].weight.detach()[kept_rows].clone()
    redundancy_clean(model, cfg)
    assert model[0].weight.shape == (4, 8) and model[0].bias.shape == (4,) and model[0].out_features == 4
    assert model[2].weight.shape == (8, 4) and model[2].in_features == 4
    torch.testing.assert_close(model[0].weight.detach(), before)
    torch.testing.assert_close(model(x), masked)


def test_row_pruning_without_related_modules_zeroes_rows():
    model = mlp()
    cfg = section(row_pruning=pruning("l1", 0.5, modules=["^2$"]))
    init_compression(model, cfg)
    compression_scheduler(model, cfg)
    x = torch.randn(3, 8)
    masked = model(x)
    redundancy_clean(model, cfg)
    assert model[2].weight.shape == (8, 16)
    assert int((model[2].weight.abs().sum(1) == 0).sum()) == 4
    torch.testing.assert_close(model(x), masked)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.side = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x)))


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_channel_pruning_shrinks_conv_and_its_related_modules(method):
    net = ConvNet()
    cfg = section(channel_pruning=pruning(method, 0.5, modules=["conv1"], related=[["conv2", "bn"]]))
    init_compression(net, cfg)
    assert isinstance(net.conv1, Conv2dLayer_Compress)
    compression_scheduler(net, cfg)
    net.bn.running_mean.copy_(torch.arange(8.0))
    x = torch.randn(2, 3, 6, 6)
    masked = net(x)
    kept = net.conv1.get_mask("channel").reshape(-1).bool()
    redundancy_clean(net, cfg)
    assert net.conv1.weight.shape == (4, 3, 3, 3) and net.conv1.out_channels == 4
    assert net.conv2.weight.shape == (4, 4, 3, 3) and net.conv2.in_channels == 4
    assert net.bn.weight.shape == (4,) and net.bn.num_features == 4
    torch.testing.assert_close(net.bn.running_mean, torch.arange(8.0)[kept])
    torch.testing.assert_close(net(x), masked)
    assert net.side.weight.shape == (2, 8, 1, 1)  # not named: untouched


def test_conv_and_embedding_layers_quantize_and_prune():
    net, stack = ConvNet(), Stack(1, 0)
    cfg = section(weight_quantization=wq(start=4, target=4, modules=["conv2", "embed"]),
                  sparse_pruning=pruning("l1", 0.5, modules=["conv1"]))
    stack_cfg = section(weight_quantization=cfg["compression_training"]["weight_quantization"])
    init_compression(net, cfg)  # "embed" matches nothing in the ConvNet: a warning, the group still has conv2
    init_compression(stack, stack_cfg)
    compression_scheduler(net, cfg), compression_scheduler(stack, stack_cfg)
    assert max(_distinct_per_group(net.conv2.compressed_weight(), 1)) <= 16
    assert max(_distinct_per_group(stack.embed.compressed_weight(), 10)) <= 16  # one scale per token row
    assert int((net.conv1.compressed_weight() != 0).sum()) == net.conv1.weight.numel() // 2
    x = torch.randn(1, 3, 5, 5)
    masked = net(x)
    redundancy_clean(net, cfg)
    assert max(_distinct_per_group(net.conv2.weight, 1)) <= 16
    torch.testing.assert_close(net(x), masked)
    everything = Stack(2, 0)  # "*" is the documented "All Linear and CONV2D layers": embeddings only by name
    init_compression(everything, section(weight_quantization=wq(start=4, target=4, modules=["*"])))
    assert type(everything.embed) is nn.Embedding
    assert all(isinstance(m, LinearLayer_Compress) for m in (*everything.blocks, everything.head))


# ---------------------------------------------------------------------------------------------- layer reduction
class Stack(nn.Module):
    def __init__(self, layers: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        self.head = nn.Linear(8, 2)


def test_layer_reduction_initializes_the_student_from_teacher_layers():
    teacher, student = Stack(6, 0), Stack(6, 1)
    cfg = section(layer_reduction={"enabled": True, "keep_number_layer": 3, "module_name_prefix": "blocks",
                                   "teacher_layer": [1, 3, 5], "other_module_name": ["embed"]})
    init_compression(student, cfg, teacher_model=teacher)
    assert len(student.blocks) == 3  # cut to keep_number_layer
    for s_idx, t_idx in enumerate([1, 3, 5]):
        torch.testing.assert_close(student.blocks[s_idx].weight, teacher.blocks[t_idx].weight)
    torch.testing.assert_close(student.embed.weight, teacher.embed.weight)
    assert not torch.equal(student.head.weight, teacher.head.weight)  # not listed: the student's own


def test_layer_reduction_errors_name_the_problem():
    cfg = section(layer_reduction={"enabled": True, "keep_number_layer": 2, "module_name_prefix": "blocks",
                                   "teacher_layer": [1, 9]})
    with pytest.raises(ValueError, match="needs teacher_model"):
        init_compression(Stack(4, 0), cfg)
    with pytest.raises(ValueError, match="teacher_layer: layer 9 does not exist"):
        init_compression(Stack(4, 0), cfg, teacher_model=Stack(4, 1))
    bad = section(layer_reduction={"enabled": True, "keep_number_layer": 1, "other_module_name": ["head"]})
    teacher = Stack(2, 0)
    teacher.head = nn.Linear(8, 3)
    with pytest.raises(ValueError, match="'head': weight has shape"):
        init_compression(Stack(2, 1), bad, teacher_model=teacher)


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("techniques, match", [
    ({"row_pruning": pruning(modules=["nothing_here"])}, "matches no Linear module"),
    ({"row_pruning": pruning(modules=["["])}, "not a valid regular expression"),
    ({"row_pruning": pruning(modules=["0"], related=[["0|2"]])}, "matches 2 modules but the pruned"),
    ({"sparse_pruning": pruning(method="snip_momentum", modules=["0"])}, "snip_momentum"),
    ({"weight_quantization": wq(groups=7)}, "quantize_groups=7 must divide"),
    ({"weight_quantization": wq(start=2, target=2, qtype="asymmetric")}, "symmetric only"),
    ({"head_pruning": pruning(method="topk", num_heads=3, modules=["0"])}, "num_heads=3 must divide"),
])
def test_bad_settings_are_clear_errors(techniques, match):
    with pytest.raises(ValueError, match=match):
        init_compression(mlp(), section(**techniques))


@pytest.mark.parametrize("techniques, key", [
    ({"weight_quantization": wq(start=4, target=8)}, "weight_quantization.different_groups.wq1.params.target_bits"),
    ({"row_pruning": pruning(method="magnitude")}, "row_pruning.shared_parameters.method"),
    ({"row_pruning": pruning(ratio=1.5)}, "row_pruning.different_groups.g1.params.dense_ratio"),
    ({"head_pruning": pruning(method="topk")}, "head_pruning.shared_parameters.num_heads"),
])
def test_bad_config_values_name_their_key(techniques, key):
    with pytest.raises(ConfigError) as err:
        init_compression(mlp(), section(**techniques))
    assert f"compression_training.{key}" in str(err.value)


def test_scheduler_needs_a_prepared_model_and_topk_mask_keeps_ceil():
    with pytest.raises(RuntimeError, match="call deepspeed.compression.init_compression"):
        compression_scheduler(mlp(), section(sparse_pruning=pruning()))
    assert int(topk_mask(torch.randn(10), 0.25).sum()) == 3

"""ds_to_universal on a ZeRO-3 AutoEP checkpoint, hand-corrupted: an expert parameter whose put-together size is
not exactly ``num_experts`` experts (here: a whole multiple of it, which the converter once accepted) is refused
with its name, the size found and the size expected; the intact checkpoint converts with every expert file at its
exact size. The ``ep_rank`` of each rank is read without unpickling its whole model-states file."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

TAG = "z3"


class _Experts(nn.Module):  # a Mixtral-style fused expert block: [E, 2F, H] and [E, H, F]
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 12, 8) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(4, 8, 6) * 0.1)


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = _Experts()
        self.top_k = 2


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"model_type": "mixtral", "num_local_experts": 4, "hidden_size": 8,
                                       "intermediate_size": 6, "num_experts_per_tok": 2})()
        self.inp = nn.Linear(8, 8)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = _MoEBlock()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.model.layers[0].mlp(h))


def _save(save_dir: str) -> None:
    import deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 3},
              "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral",
                                  "use_grouped_mm": False}}
    engine, *_ = deepspeed.initialize(model=_Model(), config=config)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(dist.get_rank() // 2))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.save_checkpoint(save_dir, tag=TAG)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("autoep_z3")
    run_distributed(_save, world_size=4, args=(str(root),), timeout=180)
    return str(root)


def _model_files(tag_dir: str) -> list[str]:
    return sorted(os.path.join(tag_dir, n) for n in os.listdir(tag_dir) if n.endswith("_model_states.pt")
                  and n.startswith("zero_pp_rank_"))


def test_intact_checkpoint_converts_with_exact_expert_sizes(saved, tmp_path):
    from deepspeed.checkpoint.ds_to_universal import convert

    out = convert(os.path.join(saved, TAG), str(tmp_path / "universal"))
    for weight, per_expert in (("w1", 6 * 8), ("w2", 8 * 6), ("w3", 6 * 8)):
        obj = torch.load(os.path.join(out, "zero", f"model.layers.0.mlp.experts.{weight}", "fp32.pt"),
                         weights_only=True)
        assert obj["is_expert_param"] and obj["ep_num_experts"] == 4
        assert obj["param"].numel() == 4 * per_expert


def test_expert_size_a_whole_multiple_of_the_expected_one_is_refused(saved, tmp_path):
    """Ranks 2 and 3 claim expert-parallel ranks 2 and 3: four expert groups of 2 experts, 8 experts in all, where
    ds_autoep_layers says 4 (a whole multiple the old check let through, writing twice the experts)."""
    from deepspeed.checkpoint.ds_to_universal import UniversalConversionError, convert

    tag_dir = tmp_path / TAG
    shutil.copytree(os.path.join(saved, TAG), tag_dir)
    for path in _model_files(str(tag_dir))[2:]:
        state = torch.load(path, weights_only=False)
        for entry in state["ds_autoep_layers"]:
            entry["ep_rank"] += 2
        torch.save(state, path)
    with pytest.raises(UniversalConversionError) as err:
        convert(str(tag_dir), str(tmp_path / "universal"))
    message = str(err.value)
    assert "model.layers.0.mlp.experts.w" in message
    # one expert of w1/w3 is 6 x 8, of w2 8 x 6: 8 experts found, 4 expected
    assert f"{8 * 48}" in message and f"{4 * 48}" in message, message


def test_ep_rank_is_read_without_the_tensors(saved):
    from deepspeed.checkpoint.autoep_zero3 import read_ep_ranks

    files = _model_files(os.path.join(saved, TAG))
    assert read_ep_ranks(files) == [0, 1, 0, 1]


def test_plain_entries_leave_tensors_unread(saved):
    from deepspeed.checkpoint.state_metadata import Opaque, read_plain_entries

    path = _model_files(os.path.join(saved, TAG))[1]
    entries = read_plain_entries(path, ["ds_autoep_layers", "module", "global_steps", "no_such_key"])
    assert sorted(entries) == ["ds_autoep_layers", "global_steps", "module"]
    assert entries["global_steps"] == 1 and entries["ds_autoep_layers"][0]["num_experts"] == 4
    assert entries["module"] and all(isinstance(v, Opaque) for v in entries["module"].values())


def test_written_expert_file_of_a_whole_multiple_is_refused(saved, tmp_path):
    """The check after writing (``--no_strict`` skips it): an expert file holding twice its experts is refused."""
    from deepspeed.checkpoint._conversion import UniversalConversionError, _verify
    from deepspeed.checkpoint.ds_to_universal import convert
    from ds_zero import zero_to_fp32 as z

    out = convert(os.path.join(saved, TAG), str(tmp_path / "universal"))
    zero_dir = os.path.join(out, "zero")
    rank0 = _model_files(os.path.join(saved, TAG))[0]
    shapes = z.read_param_shapes(z.load_checkpoint_file(rank0), rank0)
    whole = {f"model.layers.0.mlp.experts.{w}": 4 * 48 for w in ("w1", "w2", "w3")}
    _verify(zero_dir, shapes, ["fp32"], whole)  # as written: exact
    path = os.path.join(zero_dir, "model.layers.0.mlp.experts.w2", "fp32.pt")
    obj = torch.load(path, weights_only=True)
    obj["param"] = torch.cat([obj["param"], obj["param"]])
    torch.save(obj, path)
    with pytest.raises(UniversalConversionError, match=r"384 values, expert parameter "
                                                       r"'model\.layers\.0\.mlp\.experts\.w2' needs 192"):
        _verify(zero_dir, shapes, ["fp32"], whole)

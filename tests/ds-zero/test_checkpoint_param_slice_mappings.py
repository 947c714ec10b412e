"""``param_slice_mappings`` in ZeRO stage 1/2 optimizer files: per group, each parameter's piece of the rank's fp32
partition as DeepSpeed's ``fragment_address`` (``numel``, ``start``), which DeepSpeed's ``ds_to_universal`` cuts
every rank's flat states by. Checked by hand on an uneven layout, then on 2 gloo ranks through the engine's save:
the pickled class, the offsets, and the cut of every rank's masters and Adam moments, which must rebuild each whole
parameter (what the converter writes). Files without the key (written before it) still load bitwise.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_zero._flat_group import FlatGroup
from ds_zero.optimizer_state import param_slice_mappings

# 26 elements, alignment 4 -> 28 padded, 14 per rank: p2 straddles the ranks, p3 is empty, rank 1 ends in padding
NUMELS = [5, 7, 3, 0, 11]
BY_HAND = [
    {"p0": {"numel": 5, "start": 0}, "p1": {"numel": 7, "start": 5}, "p2": {"numel": 2, "start": 12}},
    {"p2": {"numel": 1, "start": 0}, "p4": {"numel": 11, "start": 1}},
]


def _flat_group(rank: int) -> tuple[FlatGroup, list[torch.Tensor]]:
    values = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(NUMELS)]
    params = [torch.nn.Parameter(v.clone()) for v in values]
    return FlatGroup(params, [f"p{i}" for i in range(len(NUMELS))], 2, rank, torch.float32,
                     torch.device("cpu")), values


@pytest.mark.parametrize("rank", [0, 1])
def test_mappings_of_an_uneven_layout_by_hand(rank):
    fg, _ = _flat_group(rank)
    assert fg.layout.partition_numel == 14 and fg.layout.padding == 2
    assert param_slice_mappings([fg]) == [BY_HAND[rank]]
    assert list(param_slice_mappings([fg])[0]) == list(BY_HAND[rank])  # flat order, as DeepSpeed's OrderedDict


def test_the_pieces_rebuild_every_parameter():
    """What ``ds_to_universal`` does with them: narrow each rank's master, concatenate in rank order."""
    groups = [_flat_group(rank) for rank in range(2)]
    _, values = groups[0]
    mappings = [param_slice_mappings([fg])[0] for fg, _ in groups]
    for i, value in enumerate(values):
        name = f"p{i}"
        pieces = [fg.master.detach().narrow(0, m[name]["start"], m[name]["numel"])
                  for (fg, _), m in zip(groups, mappings, strict=True) if name in m]
        rebuilt = torch.cat(pieces) if pieces else torch.empty(0)
        assert torch.equal(rebuilt, value), name


# ---- through the engine on 2 ranks --------------------------------------------------------------------------------
class Uneven(torch.nn.Module):
    """41 trainable elements (one group): the 2 partitions are 22 elements, the last 3 of rank 1's padding."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 5)  # 15 + 5
        self.b = torch.nn.Linear(5, 3)  # 15 + 3
        self.c = torch.nn.Linear(3, 1, bias=False)  # 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _config(stage: int, dtype: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(cfg: dict, seed: int):
    import deepspeed

    torch.manual_seed(seed)
    return deepspeed.initialize(model=Uneven(), config=cfg)[0]


def _step(engine, step: int) -> float:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(2, 3, generator=gen), torch.randn(2, 1, generator=gen)
    dtype = engine.module.a.weight.dtype
    loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _save(cfg: dict, save_dir: str) -> dict:
    engine = _engine(cfg, seed=0)
    for step in range(2):
        _step(engine, step)
    engine.save_checkpoint(save_dir, tag="t")
    fg = engine.optimizer.groups[0]
    state = engine.optimizer.optimizer.state[fg.master]
    return {"exp_avg": state["exp_avg"].detach().clone(), "master": fg.master.detach().clone(),
            "continued": [_step(engine, step) for step in range(2, 4)]}


def _load_and_continue(cfg: dict, save_dir: str) -> list[float]:
    engine = _engine(cfg, seed=dist.get_rank() + 7)  # other weights: everything must come from the files
    path, _ = engine.load_checkpoint(save_dir, tag="t")
    assert path is not None
    return [_step(engine, step) for step in range(2, 4)]


def _optim_files(tag_dir: str, dtype: str) -> list[str]:
    prefix = "bf16_" if dtype == "bf16" else ""
    return [os.path.join(tag_dir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(2)]


@pytest.mark.parametrize("stage,dtype", [(1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16")])
def test_saved_files_hold_deepspeeds_fragment_addresses(tmp_path, stage, dtype):
    from deepspeed.runtime.checkpointing.serialize import load_file
    from deepspeed.utils.tensor_fragment import fragment_address
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cfg = _config(stage, dtype)
    ranks = run_distributed(_save, world_size=2, args=(cfg, str(tmp_path)), timeout=90)
    files = [load_file(p)["optimizer_state_dict"] for p in _optim_files(str(tmp_path / "t"), dtype)]
    want = [OrderedDict([("a.weight", (15, 0)), ("a.bias", (5, 15)), ("b.weight", (2, 20))]),
            OrderedDict([("b.weight", (13, 0)), ("b.bias", (3, 13)), ("c.weight", (3, 16))])]
    for rank, sd in enumerate(files):
        (group,) = sd["param_slice_mappings"]
        assert type(group) is OrderedDict
        assert all(type(a) is fragment_address for a in group.values())
        assert type(next(iter(group.values()))).__module__ == "deepspeed.utils.tensor_fragment"
        assert [(n, (a.numel, a.start)) for n, a in group.items()] == list(want[rank].items())
        # the file's flat states are the live ones (what the converter narrows)
        assert torch.equal(sd["single_partition_of_fp32_groups"][0][:22], ranks[rank]["master"])
        assert torch.equal(sd["base_optimizer_state"]["state"][0]["exp_avg"], ranks[rank]["exp_avg"])
    # ds_to_universal's cut: every rank's pieces in rank order rebuild each whole fp32 parameter and moment
    full = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    for name, value in full.items():
        for key in ("fp32", "exp_avg"):
            pieces = []
            for sd in files:
                address = sd["param_slice_mappings"][0].get(name)
                flat = (sd["single_partition_of_fp32_groups"][0] if key == "fp32"
                        else sd["base_optimizer_state"]["state"][0][key])
                if address is not None:
                    pieces.append(flat.narrow(0, address.start, address.numel))
            rebuilt = torch.cat(pieces)
            assert rebuilt.numel() == value.numel(), (name, key)
            if key == "fp32":
                assert torch.equal(rebuilt.view(value.shape), value), name


def test_files_without_the_key_still_load_bitwise(tmp_path):
    """Files from before the key (or with it stripped) load as before: same continued losses as the saver's."""
    cfg = _config(2, "fp32")
    saved = run_distributed(_save, world_size=2, args=(cfg, str(tmp_path)), timeout=90)
    for path in _optim_files(str(tmp_path / "t"), "fp32"):
        obj = torch.load(path, weights_only=False)
        del obj["optimizer_state_dict"]["param_slice_mappings"]
        torch.save(obj, path)
    loaded = run_distributed(_load_and_continue, world_size=2, args=(cfg, str(tmp_path)), timeout=90)
    assert [r["continued"] for r in saved] == loaded


def test_universal_step_of_deepspeeds_stage3_conversion():
    """DeepSpeed's converter writes no ``step.pt`` at stage 3 and no ``step`` in ``param_groups``: the step is that
    of the saving rank's optimizer state it copies into ``zero/optimizer_state.pt`` (state 0 for every group)."""
    from ds_zero.checkpoint import universal_step

    step = torch.tensor(4.0)
    common = {"param_groups": [{"lr": 0.1}, {"lr": 0.1}],
              "optimizer_state_dict": {"state": {0: {"step": step, "exp_avg": torch.zeros(3)}}}}
    assert universal_step(None, None, [], common, 0) == {"step": step}
    assert universal_step(None, None, [], common, 1) == {"step": step}
    assert universal_step(None, None, [], {"param_groups": [{"lr": 0.1, "step": 7}]}, 0) == {"step": 7}
    assert universal_step(None, None, [], {"param_groups": [{"lr": 0.1}]}, 0) == {}

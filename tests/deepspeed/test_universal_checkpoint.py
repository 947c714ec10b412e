"""Universal Checkpoints: ``ds_to_universal`` converts a ZeRO-2 checkpoint saved by 2 ranks;
``checkpoint.load_universal`` restores it onto 1 rank (ZeRO-1) and 4 ranks (ZeRO-2) with the saved fp32 weights and
Adam states, and the next step matches the step the original run took after saving."""

from __future__ import annotations

import os

import pytest
import torch
from _harness import run_distributed


def _config(stage: int, universal: bool, world: int) -> dict:
    return {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage}, "checkpoint": {"load_universal": universal}}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _engine(stage: int, universal: bool, world: int):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return deepspeed.initialize(model=model, config=_config(stage, universal, world))[0]


def _step(engine, step: int, ranks: list[int]) -> None:
    """One optimizer step over the global batch of the 2-rank run (split over this engine's ranks)."""
    xs, ys = zip(*(_batch(step, r) for r in range(2)), strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    rows = x.shape[0] // len(ranks)
    me = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    part = slice(me * rows, (me + 1) * rows)
    loss = torch.nn.functional.mse_loss(engine(x[part]), y[part])
    engine.backward(loss)
    engine.step()


def _full_state(engine) -> dict:
    """name -> (fp32 weight, exp_avg, exp_avg_sq), whole, from this engine's own optimizer."""
    opt = engine.optimizer
    if not hasattr(opt.groups[0], "layout") or not hasattr(opt.groups[0].layout, "partition_range"):
        return _full_state3(opt)
    out = {}
    for fg in opt.groups:
        lo, hi = fg.layout.partition_range(fg.rank)
        state = opt.optimizer.state[fg.master]
        flats = {k: torch.zeros(fg.layout.padded_numel) for k in ("fp32", "exp_avg", "exp_avg_sq")}
        flats["fp32"][lo:hi] = fg.master.detach()
        flats["exp_avg"][lo:hi] = state["exp_avg"]
        flats["exp_avg_sq"][lo:hi] = state["exp_avg_sq"]
        if torch.distributed.is_initialized():
            for t in flats.values():
                torch.distributed.all_reduce(t)
        for name, off, n in zip(fg.names, fg.layout.offsets, fg.layout.numels, strict=True):
            out[name] = tuple(flats[k][off:off + n].clone() for k in ("fp32", "exp_avg", "exp_avg_sq"))
    return out


def _full_state3(opt) -> dict:
    out = {}
    for group in opt.groups:
        state = opt.optimizer.state[group.master]
        flats = {"fp32": group.master.detach(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        for name, p, off in zip(group.names, group.params, group.offsets, strict=True):
            part = p.ds_tensor.numel()
            values = []
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                pieces = [torch.zeros(part) for _ in range(opt.world)]
                torch.distributed.all_gather(pieces, flats[key][off:off + part].contiguous().float())
                values.append(torch.cat(pieces)[:p.ds_numel].clone())
            out[name] = tuple(values)
    return out


def _save_run(work: str) -> dict:
    engine = _engine(2, False, 2)
    for step in range(2):
        _step(engine, step, [0, 1])
    engine.save_checkpoint(work, tag="global_step2")
    saved = _full_state(engine)
    _step(engine, 2, [0, 1])
    after = {n: v[0] for n, v in _full_state(engine).items()}
    return {"saved": saved, "after": after}


def _load_run(work: str, stage: int, world: int) -> dict:
    engine = _engine(stage, True, world)
    path, _ = engine.load_checkpoint(work)
    loaded = _full_state(engine)
    _step(engine, 2, list(range(world)))
    after = {n: v[0] for n, v in _full_state(engine).items()}
    return {"path": path, "loaded": loaded, "after": after, "steps": engine.global_steps}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from deepspeed.checkpoint import ds_to_universal

    work = str(tmp_path_factory.mktemp("uc"))
    ref = run_distributed(_save_run, world_size=2, args=(work,), timeout=90)[0]
    out = os.path.join(work, "global_step2_universal")
    args = ds_to_universal.parse_arguments(["--input_folder", os.path.join(work, "global_step2"),
                                            "--output_folder", out, "--inject_missing_state"])
    assert ds_to_universal.main(args) == 0
    return work, out, ref


def test_layout(converted):
    work, out, ref = converted
    with open(os.path.join(work, "latest_universal")) as handle:
        assert handle.read() == "global_step2_universal"
    assert os.path.isfile(os.path.join(out, "mp_rank_00_model_states.pt"))
    assert os.path.isfile(os.path.join(out, "zero", "optimizer_state.pt"))
    for name, (fp32, exp_avg, exp_avg_sq) in ref["saved"].items():
        folder = os.path.join(out, "zero", name)
        got = torch.load(os.path.join(folder, "fp32.pt"), weights_only=True)
        assert got["cat_dim"] == 0
        torch.testing.assert_close(got["param"].reshape(-1), fp32, rtol=0, atol=0)
        torch.testing.assert_close(torch.load(os.path.join(folder, "exp_avg.pt"))["param"].reshape(-1), exp_avg)
        torch.testing.assert_close(torch.load(os.path.join(folder, "exp_avg_sq.pt"))["param"].reshape(-1), exp_avg_sq)
        assert float(torch.load(os.path.join(folder, "step.pt"))) == 2.0


@pytest.mark.parametrize(("stage", "world"), [(1, 1), (2, 4), (3, 4)])
def test_load_on_other_world_sizes(converted, stage, world):
    work, _, ref = converted
    results = run_distributed(_load_run, world_size=world, args=(work, stage, world), timeout=90)
    for r in results:
        assert r["path"].endswith(os.path.join("global_step2_universal", "mp_rank_00_model_states.pt"))
        assert r["steps"] == 3
        for name, saved in ref["saved"].items():
            for got, want in zip(r["loaded"][name], saved, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(r["after"][name], ref["after"][name], rtol=1e-6, atol=1e-7)


def _load_error(work: str) -> str:
    engine = _engine(2, True, 1)
    try:
        engine.load_checkpoint(work, tag="global_step2")
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_non_universal_folder_is_refused(converted):
    work, _, _ = converted
    msg = run_distributed(_load_error, world_size=1, args=(work,), timeout=60)[0]
    assert "CheckpointError" in msg and os.path.join(work, "global_step2") in msg and "zero" in msg


def test_missing_parameter_folder(converted, tmp_path):
    import shutil

    work, out, _ = converted
    copy = tmp_path / "global_step2"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "zero" / "0.weight")
    msg = run_distributed(_load_error, world_size=1, args=(str(tmp_path),), timeout=60)[0]
    assert "0.weight" in msg and "fp32.pt" in msg, msg


def test_missing_universal_info_without_inject(converted, tmp_path):
    from deepspeed.checkpoint import ds_to_universal

    work, _, _ = converted
    with pytest.raises(ds_to_universal.UniversalConversionError, match="universal_checkpoint_info"):
        ds_to_universal.main(["--input_folder", os.path.join(work, "global_step2"),
                              "--output_folder", str(tmp_path / "out")])

"""DeepSpeed's file helpers of ``zero_to_fp32``: ``get_optim_files`` / ``get_model_state_files`` list a tag
folder's rank files in rank order (natural sort: rank 10 after rank 9), on hand-written folders and on the
checkpoints real DeepSpeed 0.19.8 wrote (``fixtures/deepspeed_0_19_8``)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch

from ds_zero import zero_to_fp32 as z2f

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed_0_19_8"


def _write_ranks(tag_dir: Path, world: int) -> None:
    """One optimizer file and one ZeRO-3 model-states file per rank, each recording its rank, plus noise."""
    tag_dir.mkdir(parents=True)
    for rank in reversed(range(world)):  # creation order must not matter
        torch.save({"rank": rank}, tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        torch.save({"rank": rank}, tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    (tag_dir / "notes.txt").write_text("not a checkpoint file")
    torch.save({}, tag_dir / "client_state.pt")


def _ranks(files: list[str]) -> list[int]:
    return [torch.load(f, weights_only=True)["rank"] for f in files]


def test_files_come_in_rank_order_past_rank_nine(tmp_path):
    tag_dir = tmp_path / "global_step7"
    _write_ranks(tag_dir, world=12)
    optim = z2f.get_optim_files(tag_dir)
    models = z2f.get_model_state_files(str(tag_dir))
    assert _ranks(optim) == list(range(12)) and _ranks(models) == list(range(12))
    assert optim[10] == os.path.join(str(tag_dir), "zero_pp_rank_10_mp_rank_00_optim_states.pt")
    assert all(isinstance(f, str) for f in optim + models)


@pytest.mark.parametrize("case", ["stage1_fp32", "stage2_bf16", "stage3_fp32", "stage3_bf16"])
def test_real_deepspeed_checkpoints(case):
    tag_dir = FIXTURES / case / "global_step3"
    prefix = "bf16_" if case.endswith("bf16") else ""
    want_optim = [str(tag_dir / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(2)]
    want_models = ([str(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(2)]
                   if case.startswith("stage3") else [str(tag_dir / "mp_rank_00_model_states.pt")])
    assert z2f.get_optim_files(tag_dir) == want_optim
    assert z2f.get_model_state_files(tag_dir) == want_models
    # the files really are what their names say: each optimizer file is one of 2 partitions (read with the
    # converter's own loader, which stands in for the DeepSpeed classes these files pickle)
    for path in want_optim:
        count = z2f.load_checkpoint_file(path)["optimizer_state_dict"]["partition_count"]
        assert set(count if isinstance(count, list) else [count]) == {2}


def test_missing_files_raise_file_not_found(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"\*_optim_states\.pt"):
        z2f.get_optim_files(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"\*_model_states\.pt"):
        z2f.get_model_state_files(tmp_path / "does-not-exist")


def test_served_at_deepspeeds_path(tmp_path):
    module = importlib.import_module("deepspeed.utils.zero_to_fp32")
    assert module.get_optim_files is z2f.get_optim_files
    assert module.get_model_state_files is z2f.get_model_state_files

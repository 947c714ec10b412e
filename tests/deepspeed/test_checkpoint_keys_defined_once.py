"""Checkpoint keys shared by the writer (ds-zero) and the Universal Checkpoint converter (deepspeed.checkpoint) are
defined once: the converter imports the writer's name, so the two cannot drift apart."""

from __future__ import annotations

from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2] / "packages"


def test_partition_groups_key_is_the_writers():
    from deepspeed.checkpoint import autoep_zero3
    from ds_zero.zero3 import checkpoint

    assert autoep_zero3.PARTITION_GROUPS is checkpoint.PARTITION_GROUPS
    assert checkpoint.PARTITION_GROUPS == "ds_zero_partition_groups"  # the key in files already written


def test_partition_groups_key_is_spelled_out_once():
    hits = sorted(str(path.relative_to(PACKAGES)) for path in PACKAGES.rglob("*.py")
                  if '"ds_zero_partition_groups"' in path.read_text(encoding="utf-8"))
    assert hits == ["ds-zero/src/ds_zero/zero3/checkpoint.py"]

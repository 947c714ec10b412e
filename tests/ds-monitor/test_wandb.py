"""W&B monitor: an offline run (``WANDB_MODE=offline``) read back from its ``.wandb`` transaction log."""

from __future__ import annotations

from ds_config.monitor import WandbConfig
from ds_monitor import WandbMonitor

LOSS, LR = "Train/Samples/train_loss", "Train/Samples/lr"


def test_offline_run_history(wandb_offline, read_wandb):
    cfg = WandbConfig(enabled=True, project="ds-tests", group="grp", team="my-team")
    monitor = WandbMonitor(cfg, rank=0)
    monitor.write_events([(LOSS, 2.5, 8), (LR, 0.001, 8)])
    monitor.write_events([(LOSS, 1.25, 16)])
    monitor.write_events([(LR, 0.0005, 16), (LOSS, 0.5, 24)])  # one call may span steps
    monitor.close()
    run, history = read_wandb(wandb_offline)
    assert (run.project, run.run_group, run.entity) == ("ds-tests", "grp", "my-team")
    assert history == {8: {LOSS: 2.5, LR: 0.001}, 16: {LOSS: 1.25, LR: 0.0005}, 24: {LOSS: 0.5}}


def test_other_rank_starts_no_run(wandb_offline):
    monitor = WandbMonitor({"enabled": True}, rank=1)
    monitor.write_events([(LOSS, 1.0, 1)])
    monitor.close()
    assert monitor.run is None and not (wandb_offline / "wandb").exists()

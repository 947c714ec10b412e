"""Training monitors: TensorBoard, Weights & Biases, Comet and CSV writers behind one MonitorMaster, configured by the tensorboard, wandb, comet and csv_monitor config sections."""

from ds_monitor.__about__ import __version__

__all__ = ["__version__"]

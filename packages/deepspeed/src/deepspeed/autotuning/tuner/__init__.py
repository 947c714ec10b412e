"""Search strategies over a tuning space: grid search, random order, and a cost-model guided search."""

from deepspeed.autotuning.tuner.base_tuner import BaseTuner
from deepspeed.autotuning.tuner.index_based_tuner import GridSearchTuner, RandomTuner
from deepspeed.autotuning.tuner.model_based_tuner import ModelBasedTuner

__all__ = ["BaseTuner", "GridSearchTuner", "RandomTuner", "ModelBasedTuner"]

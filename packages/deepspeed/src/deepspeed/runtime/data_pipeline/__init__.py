"""Data efficiency: curriculum learning (schedules, data analysis, curriculum sampling) and random-LTD.

Served here: ``curriculum_scheduler`` (CurriculumScheduler), ``constants``, ``data_routing`` (RandomLTDScheduler,
RandomLayerTokenDrop, convert_to_random_ltd) and ``data_sampling`` (DataAnalyzer, DeepSpeedDataSampler,
MMapIndexedDataset, dynamic batching in ``variable_batch_size_and_lr``).
"""

from deepspeed.compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)

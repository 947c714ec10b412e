"""Data efficiency: the curriculum-learning difficulty scheduler and random layerwise token dropping (random-LTD).

Served here: ``curriculum_scheduler`` (CurriculumScheduler), ``constants``, ``data_routing`` (RandomLTDScheduler,
RandomLayerTokenDrop, convert_to_random_ltd). The data-sampling half (DataAnalyzer, DeepSpeedDataSampler) is not
built yet: ``deepspeed.runtime.data_pipeline.data_sampling`` raises ``FeatureNotAvailable``.
"""

from deepspeed._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)

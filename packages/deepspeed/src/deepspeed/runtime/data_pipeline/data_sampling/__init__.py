"""Data sampling of the Data Efficiency Library: offline analysis and curriculum batch sampling.

``data_analyzer.DataAnalyzer`` computes per-sample curriculum metrics and writes the index files;
``data_sampler.DeepSpeedDataSampler`` draws batches by the curriculum from them; ``indexed_dataset`` reads and
writes the ``MMapIndexedDataset`` files both use; ``utils`` holds the small shared helpers.
"""

from deepspeed._compat import submodule_getattr

__getattr__ = submodule_getattr(__name__)
